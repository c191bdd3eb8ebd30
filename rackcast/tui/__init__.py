"""rackcast's Textual terminal UI: screens over the planner, simulator and compare (see rackcast.tui.app).

    python tui.py      or      rackcast tui
"""
