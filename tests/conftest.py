"""Shared test helpers: run the CLI in a subprocess, the repository root."""

from __future__ import annotations

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
