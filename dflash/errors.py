"""Error types that the CLI maps to exit codes (2 = bad input, 1 = failure)."""


class DflashError(Exception):
    """Base class of the errors dflash reports as one readable line."""


class BadInput(DflashError):
    """The user's input (config, data, paths) is wrong; the message names it and the fix. Exit code 2."""


class ConfigError(BadInput):
    """A configuration key is unknown, has the wrong type or an impossible value."""


class DataError(BadInput):
    """A dataset is missing or malformed."""


class DiskFull(DflashError):
    """No space left where the run writes (checkpoints, metrics); the message names the directory. Exit code 1."""


class Diverged(DflashError):
    """The loss or the weights became non-finite (NaN/inf): usually optim.lr too high. No checkpoint is written
    with such weights. Exit code 1: found only while training, it may also be the data or the numerics."""
