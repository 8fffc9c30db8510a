"""`python -m cgp ...`: see cgp.cli."""
import sys

from cgp.cli import main

sys.exit(main())
