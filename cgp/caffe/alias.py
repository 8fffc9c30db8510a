"""Importing this module makes `import caffe` resolve to cgp in this interpreter (see
cgp.caffe.run): `import cgp.caffe.alias` before a pycaffe script's `import caffe`. Where a
real Caffe is importable it warns and leaves `caffe` alone; cgp.caffe.run.install(force=True)
installs the alias over it all the same."""
import warnings

from cgp.caffe.run import install
from cgp.errors import CgpError

try:
    install()
except CgpError as refused:
    warnings.warn(f"cgp.caffe.alias: {refused}", stacklevel=2)
