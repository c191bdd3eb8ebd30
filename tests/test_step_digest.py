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
    "gpt-145b-megatron": "07dd509b99ec5d2e8dec1fab84fbcb68f4459cbcb3779e9df44f01edefc85954",
    "hero": "cc1aad8857ee64318b87fde73762fd47a4cb9d7f96c30b525dba03225ff04ce8",
    "hero-16-stages": "cc869d8736f01f983e919b98fcb9107bf7f969d3c71efff1a0431fdb29688f3e",
    "tiny-2proc-ep": "f2ef4568d7c0eb4088e55e93c2ed580ae1b05f91b3478e529a58ed4e5a618af9",
    "tiny-2proc-pp": "d4984d6af146e7821f93908d37f86434f7a067f06ac439c82bc0aefb9b147a5e",
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
