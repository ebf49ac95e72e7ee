"""The one exception of the data package, in a module of its own so every data module can raise it."""


class DataError(Exception):
    """A problem the user can fix; the CLI prints it as one line, without a traceback."""
