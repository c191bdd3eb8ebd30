"""`python -m rackcast.cli` runs the CLI."""

import sys

from rackcast.cli import main

sys.exit(main())
