"""Two "nodes" on this machine: two `rackcast train --nnodes 2` launches meeting at one c10d rendezvous endpoint
(gloo on loopback) train what one process trains; a run whose launchers are killed leaves no worker behind and
resumes bitwise from its last complete checkpoint; its checkpoint resumes under other layouts (resharding), the
loss curve continuing.

    .venv/bin/pytest -q tests/test_trainer_multinode.py        (about 2 minutes on 2 cores)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rackcast.backend.checkpoint import full_model_state, latest_complete, step_dir
from conftest import ROOT
from trainer_helpers import losses, run_worker, write_plan

pytestmark = pytest.mark.slow

STEPS = 4
EP2 = {"data": 2, "expert": 2}
LAUNCH_TIMEOUT_S = 300
WORKERS_GONE_S = 30


def _ok(result):
    assert result.returncode == 0, result.stderr[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_nodes(plan: Path, out: Path, *extra: str, env: dict | None = None) -> list[subprocess.Popen]:
    """Both nodes' launchers, each in a process group of its own (as a shell starts a job)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "rackcast.cli", "train", str(plan), "--steps", str(STEPS), "--out", str(out),
           "--checkpoint-every", "2", "--threads", "1", "--log-every", "100", "--data-dir", str(ROOT / "runs" / ".data"),
           "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--ifname", "lo", *extra]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return [subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True) for _ in range(2)]


def _finish(nodes: list[subprocess.Popen]) -> list[tuple[int, str]]:
    return [(p.wait(timeout=LAUNCH_TIMEOUT_S), p.stdout.read()) for p in nodes]


def _processes_of(run: Path) -> list[str]:
    """Command lines of live processes that work on `run` (launchers, torchrun, workers)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if str(run) in cmdline and state != "Z":
            found.append(f"{pid}: {cmdline[:160]}")
    return found


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    d = tmp_path_factory.mktemp("one")
    _ok(run_worker(write_plan(d / "one.yaml", {}), d / "run", STEPS, "--checkpoint-every", "2"))
    return losses(d / "run"), full_model_state(latest_complete(d / "run"))


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    d = tmp_path_factory.mktemp("two")
    plan = write_plan(d / "ep2.yaml", EP2)
    for code, output in _finish(_launch_nodes(plan, d / "run")):
        assert code == 0, output[-3000:]
    return plan, d / "run"


def test_two_nodes_train_the_losses_of_one_process(two_nodes, one_process):
    _, run = two_nodes
    assert losses(run) == pytest.approx(one_process[0], rel=1e-6)
    record = json.loads((run / "record.json").read_text())
    assert record["world"] == 2 and record["steps"] == STEPS
    critical = record["critical_path"]
    assert critical["slowest_rank"] in (0, 1) and critical["step_time_s"] >= record["step_time_s"]


def test_killed_launchers_leave_no_worker_and_the_run_resumes_bitwise(two_nodes, tmp_path):
    plan, uninterrupted = two_nodes
    run = tmp_path / "run"
    # Rank 0 hangs at the start of step 3, after the step-2 checkpoint: the run is mid-flight when it is killed.
    nodes = _launch_nodes(plan, run, env={"RACKCAST_FAIL": "0:2:stall"})
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while latest_complete(run) is None:
        assert time.monotonic() < deadline and all(p.poll() is None for p in nodes), "no checkpoint was written"
        time.sleep(0.2)
    os.killpg(nodes[0].pid, signal.SIGTERM)  # a polite kill of one node's launcher group...
    os.killpg(nodes[1].pid, signal.SIGKILL)  # ...and a hard one of the other's
    for p in nodes:
        p.wait(timeout=LAUNCH_TIMEOUT_S)
    deadline = time.monotonic() + WORKERS_GONE_S
    while _processes_of(run):
        assert time.monotonic() < deadline, f"left running: {_processes_of(run)}"
        time.sleep(0.2)
    assert latest_complete(run) == step_dir(run, 2)
    assert not (run / "record.json").exists()
    for code, output in _finish(_launch_nodes(plan, run, "--resume")):
        assert code == 0, output[-3000:]
    assert losses(run) == losses(uninterrupted)  # bitwise


@pytest.mark.parametrize("parallel, world", [({}, 1), ({"data": 4, "expert": 4}, 4)], ids=["one-process", "ep4"])
def test_a_checkpoint_resumes_under_another_layout(parallel, world, two_nodes, one_process, tmp_path):
    """The two-node EP2 run's step-2 checkpoint (4 experts per shard) continues on one process, or with the experts
    split 4 ways over 4 processes: DCP reshards the expert stacks and their optimizer state."""
    _, saved = two_nodes
    run = tmp_path / "run"
    shutil.copytree(step_dir(saved, 2), step_dir(run, 2))
    plan = write_plan(tmp_path / "other.yaml", parallel)
    _ok(run_worker(plan, run, STEPS, "--checkpoint-every", "2", "--resume", world=world))
    ref_losses, ref_params = one_process
    assert losses(run) == pytest.approx(ref_losses, rel=1e-5)
    params = full_model_state(latest_complete(run))
    assert params.keys() == ref_params.keys()
    for key, value in ref_params.items():
        torch.testing.assert_close(params[key], value, atol=1e-5, rtol=1e-5, msg=key)
