"""`python -m cgp ...`: see cgp.cli."""
import os
import sys

# Numba builds colour-highlighted error texts at import with colorama, which then writes a
# terminal reset to stdout at exit wherever stdout looks like a terminal (mpirun's ranks):
# stray bytes after cgp's last line.
os.environ.setdefault("NUMBA_DISABLE_ERROR_MESSAGE_HIGHLIGHTING", "1")

from cgp.cli import main  # noqa: E402

sys.exit(main())
