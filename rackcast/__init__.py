"""rackcast: a hardware-aware simulator and planner for training large mixture-of-experts models.

The package holds the shared types (ModelSpec, Plan), the strict YAML loading they use, and the `rackcast` CLI.
Hardware lives in the top-level `topologies` package; the simulator, planner and trainer in their own packages.
"""

__version__ = "0.1.0"
