"""`python -m kvforge.tools.gpu_check`: the same command as `kvforge gpu-check`."""

import sys

from kvforge.tools.gpu_check.cli import main

sys.exit(main())
