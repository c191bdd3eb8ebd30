"""Shared test helpers: run the CLI in a subprocess, the repository root; a session-wide temporary op-count cache
(RACKCAST_CACHE, so no test reads or writes the user's cache) and the tiny-moe op counts, counted once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PLANS = ROOT / "examples" / "plans"


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rackcast.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout)


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session", autouse=True)
def op_count_cache(tmp_path_factory):
    """A temporary RACKCAST_CACHE for the whole session (CLI subprocesses inherit it): one count per model."""
    from rackcast.simulator.op_counts import CACHE_ENV

    path = tmp_path_factory.mktemp("rackcast-cache")
    old = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(path)
    yield path
    if old is None:
        os.environ.pop(CACHE_ENV, None)
    else:
        os.environ[CACHE_ENV] = old


@pytest.fixture(scope="session")
def tiny_counts(op_count_cache):
    """backend.opcount's counts of tiny-moe with MuonH (a subprocess, a few seconds, once per session)."""
    from rackcast.presets import load_model
    from rackcast.simulator.op_counts import op_counts

    return op_counts(load_model("tiny-moe"), "muonh")
