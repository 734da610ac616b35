"""Training data, the loading side: the datamodule and its train loader, token shards (the on-disk format
preparation writes), the tokenizer, mixtures of sources, validation windows, corpora of other projects read in place
(pretokenized.py) and export. Preparing a corpus (reading, deduplication, tokenization) is in preparation/."""
