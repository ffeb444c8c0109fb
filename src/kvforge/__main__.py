"""`python -m kvforge` runs the same command line as the `kvforge` script."""

import sys

from kvforge.cli import main

sys.exit(main())
