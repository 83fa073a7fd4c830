"""The one exception type of the preparation code."""


class PrepareError(RuntimeError):
    """A corpus cannot be prepared as asked.

    The message names the file or flag at fault and what to do about it; entry points print it
    without a traceback.
    """
