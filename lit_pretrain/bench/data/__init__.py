"""Bench cases of the data path (`--cases datamodule,tokenize,deduplication,data_engines,prepare_memory,mixture`):
what prepare and the datamodule deliver against the step or the library they replace."""
