"""Sharded checkpoints: every rank writes what it holds, any layout reads it back.

save.py writes a folder (ShardedSaver) and reads it whole into one process; writer.py hashes DCP's files as they are
written; manifest.py lists and verifies them; format.py reads a verified folder safely; load.py resumes a Lightning
run from one under any strategy; inspect.py and tools.py are `lit-pretrain checkpoint inspect | consolidate`.
Nothing is imported here, so reading a manifest never imports DCP's writer."""
