"""`python -m kvforge.gpu_check`: the same command as `kvforge gpu-check`."""

import sys

from kvforge.gpu_check.cli import main

sys.exit(main())
