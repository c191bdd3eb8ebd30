"""`python -m rackcast.cli` runs the CLI."""

import sys

from rackcast.cli import main

if __name__ == "__main__":
    sys.exit(main())
