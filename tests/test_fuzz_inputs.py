"""Fuzz test: seeded mutants of the tiny example plans, the tiny model presets and two topology presets, through
every loader and through `rackcast estimate` / `rackcast simulate` in this process (benchmarks/fuzz_inputs.py, the
generator of the 10,000-mutant benchmark, on a CI-sized sample): no mutant may escape as an exception other than
the one-line refusal, print a multi-line refusal or non-strict JSON, or run past the time limit.

    .venv/bin/pytest -q tests/test_fuzz_inputs.py
"""

from __future__ import annotations

import importlib.util
import sys

from conftest import ROOT

SAMPLE = 100  # mutants: a few seconds on a quiet machine
SEED = 18  # the number; any seed must pass
SOURCES = ("tiny", "local-cpu", "h100-hgx")  # small models and topologies, so simulate stays quick


def _fuzz_module():
    name = "rackcast_benchmark_fuzz_inputs"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "fuzz_inputs.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_mutated_inputs_are_refused_in_one_line_or_accepted_never_uncaught_or_hung():
    fuzz = _fuzz_module()
    est, sim = fuzz.fuzz(SAMPLE, SEED, estimate_limit_s=60.0, simulate_limit_s=120.0, only=SOURCES)
    assert est.refused + est.accepted + est.uncaught + est.hung == SAMPLE
    assert est.refused > 0 and est.accepted > 0  # the sample reaches both sides of the door
    assert (est.uncaught, est.hung) == (0, 0), est.failures
    assert (sim.uncaught, sim.hung) == (0, 0), sim.failures
    assert sim.refused + sim.accepted == est.accepted


def test_loaders_refuse_byte_level_mutants_in_one_line(tmp_path):
    """Every byte-level mutation (non-UTF-8, alias bomb, deep nesting, cut short, a changed byte) of every example
    plan, model and topology file goes through strict.load_yaml and the typed loader as a value or a RackcastError."""
    import random

    from rackcast.errors import RackcastError
    from rackcast.modelspec import ModelSpec
    from rackcast.plan import Plan
    from rackcast.strict import from_data, load_yaml
    from rackcast.topologies.spec import Topology

    fuzz = _fuzz_module()
    types = {"plan": Plan, "model": ModelSpec, "topology": Topology}
    rng = random.Random(SEED)
    for kind, docs in fuzz.load_sources().items():
        for name, doc in docs.items():
            for i in range(4):
                data, note = fuzz.mutate_bytes(fuzz.to_text(doc), rng)
                path = tmp_path / f"{kind}-{name}-{i}.yaml"
                path.write_bytes(data)
                try:
                    from_data(types[kind], load_yaml(path), where=str(path))
                except RackcastError as exc:
                    assert "\n" not in str(exc) and len(str(exc)) < 1000, (kind, name, note)
