"""User-facing errors: the command line prints their message, never a traceback."""
import importlib


class CgpError(Exception):
    """A mistake in the user's input (files, options); the message says what and where."""

class PrototxtError(CgpError):
    """A prototxt file that does not parse or names something unsupported."""

class NetError(CgpError):
    """A network that cannot be built: unsupported layer or field, shape mismatch."""

class DataError(CgpError):
    """A data set or weights file that is missing, truncated or malformed."""


def shorten(text, limit=200):
    """text, or its first `limit` characters, an ellipsis and its length: what a message
    echoes of the user's data (a name, a path, a record, a token) stays readable, and a
    50 MB layer name or garbage file is never printed whole."""
    text = str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def require(module, extra, what, package=None, error=CgpError):
    """The optional `module` of cgp's `extra`, imported; else one `error` saying that `what`
    needs it and how to install it (package: its name on PyPI, where not the module's)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = package or module.split(".")[0]
        raise error(f"{what} needs the '{package}' package: pip install 'cgp[{extra}]' (or pip "
                    f"install {package})") from None
