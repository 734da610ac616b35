"""Errors a user can act on: each message names the config key or file and says how to fix it."""


class ConfigError(ValueError):
    """A config file or override is wrong (unknown key, wrong type, value out of range)."""


class DataError(ValueError):
    """A corpus, tokenizer, shard or manifest is missing, empty, corrupted or does not match the config."""


class RunFolderError(FileExistsError):
    """A run folder already exists and the run was not told to overwrite it."""


class WorkerError(DataError):
    """A worker process of a data stage could not start, died twice on the same chunk, raised, or went silent."""


class DiskFullError(OSError):
    """A checkpoint write found no space left (ENOSPC, EDQUOT). The data is safe (the write was atomic: `latest`
    names the newest complete checkpoint); the message names the file, the bytes needed and free, that checkpoint
    and the fix."""


class StartupError(TimeoutError):
    """Ranks did not all join the rendezvous within strategy.startup_timeout_seconds; the message names them."""
