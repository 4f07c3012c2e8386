"""dsmt: DeepSpeed-configured, scalable Transformer training for neural machine translation."""

__version__ = "0.1.0"


class DsmtError(Exception):
    """A problem with the user's input: one line naming what is wrong and what to do.

    Raised once, where the bad value enters; the CLI prints it without a traceback and exits 2.
    """
