"""The simulated step, bit for bit: a SHA-256 of every metric (floats as their exact hex) and of the recorded timeline
(slices, memory points, link utilisation change points) for a few plans, against digests stored here. A change to
how the simulator computes (a faster event loop, a compiled kernel) must leave them unchanged; a change to what it
models (the physics) changes them on purpose: the failure message prints the new digests to paste in below, with
the reason in the commit message.

Stored from the simulator before its event loop was sped up (issue 17)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from rackcast.plan import load_plan
from rackcast.simulator.step import simulate

PLANS = Path(__file__).resolve().parent.parent / "examples" / "plans"


def _hero_pipeline(stages: int):
    hero = load_plan(str(PLANS / "marin-535b-hero.yaml"))
    return replace(hero, parallel=replace(hero.parallel, fsdp=64 // stages, expert=64 // stages, pipeline=stages))


CASES = {  # name -> plan builder
    "hero": lambda: load_plan(str(PLANS / "marin-535b-hero.yaml")),
    "hero-16-stages": lambda: _hero_pipeline(16),
    "gpt-145b-megatron": lambda: load_plan(str(PLANS / "gpt-145b-megatron.yaml")),
    "tiny-2proc-ep": lambda: load_plan(str(PLANS / "tiny-2proc-ep.yaml")),
    "tiny-2proc-pp": lambda: load_plan(str(PLANS / "tiny-2proc-pp.yaml")),
}
DIGESTS = {
    "gpt-145b-megatron": "fd56a971c0e502b194d3d4409db583260a86b5e1bb4c0aee669a31a41e175979",
    "hero": "b52ad864d4d1782fa7f9d2b425f950f21b62aa26248430b16580e9fb31c934e3",
    "hero-16-stages": "750808fd8c78b85ae76706c243b8a24fe2d0d7841d0abed6274ec5349aacbaa0",
    "tiny-2proc-ep": "f4a19c90ed65213e5d65ed310b4afc9506a36d91b51960523948e79a9535f8fc",
    "tiny-2proc-pp": "17dba0c76929d8a8503af6324dc15bec4e9fac57ba788389bacbb0575fb2e27a",
}


def _exact(x):
    if isinstance(x, (float, np.floating)):
        return float(x).hex()
    if isinstance(x, dict):
        return {str(k): _exact(v) for k, v in sorted(x.items())}
    if isinstance(x, (list, tuple)):
        return [_exact(v) for v in x]
    if isinstance(x, np.ndarray):
        return _exact(x.tolist())
    if isinstance(x, np.integer):
        return int(x)
    return x


def digest(plan) -> str:
    res = simulate(plan, seed=0, record=True)
    tl = res.timeline
    data = {"metrics": _exact(res.as_dict()), "slices": _exact(tl.slices),
            "memory": _exact({k: tl.memory[k] for k in sorted(tl.memory)}),
            "utilisation": _exact(list(tl.utilisation))}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


@pytest.mark.parametrize("name", sorted(CASES))
def test_simulated_step_is_bit_for_bit_the_stored_one(name):
    got = digest(CASES[name]())
    assert got == DIGESTS.get(name), f"new digest: {name!r}: {got!r},"
