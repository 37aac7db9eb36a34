"""User-facing errors: each one is printed as a single line by the CLI, with a non-zero exit."""


class MhcrunError(Exception):
    """An error caused by the user's input (a file, a flag, a checkpoint), not by a bug."""

    exit_code = 2


class ConfigError(MhcrunError):
    """A missing, malformed or inconsistent config.json."""


class CheckpointError(MhcrunError):
    """A missing, truncated or mis-shaped checkpoint tensor or shard."""


class InputError(MhcrunError):
    """A bad prompt, token id or command-line value."""


class GoldenError(MhcrunError):
    """A golden file that is missing, not JSON, of the wrong schema or of another model."""


class NonFiniteError(MhcrunError):
    """A run whose logits turned NaN or Inf: a failed run (exit 3), never turned into tokens."""

    exit_code = 3
