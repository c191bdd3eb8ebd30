"""rackcast's terminal UI: plan a run, explore layouts and model sizes, compare predicted with measured.

    python tui.py                       # opens on the plan screen
    python tui.py --screen compare --plan examples/plans/tiny-1proc.yaml --run runs/tiny-1proc
    python tui.py --light               # light theme (t toggles it at any time)

The app lives in rackcast/tui/ (one module per screen); `rackcast tui` starts the same app.
"""

import sys

from rackcast.tui.app import main

if __name__ == "__main__":
    sys.exit(main())
