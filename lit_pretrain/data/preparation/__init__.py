"""Data preparation, run once before training: documents are read, filtered for quality, deduplicated (exact hashes,
then MinHash LSH near-duplicates), split into train and validation, tokenized by worker processes or Ray, and
written as token shards with a manifest. Loading those shards for training stands beside it, in data/."""
