"""The trainer tests' helpers live in rackcast.backend.tiny_runs (the benchmarks use them too); this name stays for
the tests that import it."""

from rackcast.backend.tiny_runs import losses, manifest, routing, run_worker, write_plan  # noqa: F401
