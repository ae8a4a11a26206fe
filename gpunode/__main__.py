"""`python3 -m gpunode ...`, run from the repository's root (the node runs it there too)."""

import sys

from gpunode.cli import main

sys.exit(main())
