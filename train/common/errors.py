"""The two errors a user sees as one line (exit 2): bad configuration and bad input data."""


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the key and where it came from."""


class DataError(ValueError):
    """Bad input data; the message names the file and line."""
