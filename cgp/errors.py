"""User-facing errors: the command line prints their message, never a traceback."""

class CgpError(Exception):
    """A mistake in the user's input (files, options); the message says what and where."""

class PrototxtError(CgpError):
    """A prototxt file that does not parse or names something unsupported."""

class NetError(CgpError):
    """A network that cannot be built: unsupported layer or field, shape mismatch."""

class DataError(CgpError):
    """A data set or weights file that is missing, truncated or malformed."""
