"""`python -m meshnet.cli`: what the end-to-end tests and the demo start."""

import sys

from meshnet.cli import main

sys.exit(main())
