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
    "gpt-145b-megatron": "e4bb2ed659ad31f4fb47aa69a01070dce09f94bbb7b27611a090a88b07e15bcb",
    "hero": "5838ecf8b89cd280ca3a9b2ff73dcb21e477b9f18d0aaaa895a333f18f72e66b",
    "hero-16-stages": "7975d239a62984cf44b4160796518da8d683abe0c49d685f0fdb4e3d742319a2",
    "tiny-2proc-ep": "232d96913906ea88aa9315213f5b2fb76f877206ffa52e8eb5b7d5e865a9c9e7",
    "tiny-2proc-pp": "1c28258927b9d890719c4d5a2b58aba2bd9320214378532170e04469a9508b9b",
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
