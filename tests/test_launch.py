"""Starting a run: torchrun command lines for one and several nodes, the worker environment, the variables an existing
launcher provides, the launcher's refusals (world size, --resume) and a worker that outlives its launcher.

    .venv/bin/pytest -q tests/test_launch.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rackcast.backend.launch import Nodes, launcher_env, torchrun_command, worker_env
from conftest import PLANS, ROOT

EP_PLAN = str(PLANS / "tiny-2proc-ep.yaml")


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_one_node_runs_c10d_rendezvous_on_a_free_loopback_port():
    cmd = torchrun_command("p.yaml", 4, ["--steps", "1"])
    assert (_flag(cmd, "--nnodes"), _flag(cmd, "--nproc-per-node")) == ("1", "4")
    assert (_flag(cmd, "--rdzv-backend"), _flag(cmd, "--rdzv-endpoint")) == ("c10d", "127.0.0.1:0")


def test_several_nodes_share_the_world_and_one_endpoint():
    cmd = torchrun_command("p.yaml", 8, [], Nodes(nnodes=2, rdzv_endpoint="node0:29500"))
    assert (_flag(cmd, "--nnodes"), _flag(cmd, "--nproc-per-node")) == ("2", "4")
    assert _flag(cmd, "--rdzv-endpoint") == "node0:29500" and _flag(cmd, "--rdzv-backend") == "c10d"
    static = torchrun_command("p.yaml", 8, [], Nodes(nnodes=2, rdzv_endpoint="node0:29500", node_rank=1))
    assert _flag(static, "--rdzv-backend") == "static" and _flag(static, "--node-rank") == "1"


@pytest.mark.parametrize("nodes, message", [
    (Nodes(nnodes=2, nproc_per_node=3, rdzv_endpoint="h:1"), "the plan needs 4 processes, the launch provides 2 nodes x 3 = 6"),
    (Nodes(nnodes=3, rdzv_endpoint="h:1"), "cannot share evenly"),
    (Nodes(nnodes=2), "needs --rdzv-endpoint"),
    (Nodes(nnodes=2, rdzv_endpoint="node0"), "HOST:PORT"),
    (Nodes(nnodes=2, rdzv_endpoint="h:1", node_rank=2), "--node-rank"),
])
def test_a_launch_that_cannot_host_the_plan_is_refused(nodes, message):
    with pytest.raises(ValueError, match=message):
        torchrun_command("p.yaml", 4, [], nodes)


def test_loopback_is_only_the_one_node_default_and_ifname_sets_gloo_and_nccl(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert worker_env()["GLOO_SOCKET_IFNAME"] == "lo"
    assert "GLOO_SOCKET_IFNAME" not in worker_env(nnodes=2)
    named = worker_env(nnodes=2, ifname="eth1")
    assert named["GLOO_SOCKET_IFNAME"] == named["NCCL_SOCKET_IFNAME"] == "eth1"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    assert worker_env()["GLOO_SOCKET_IFNAME"] == "ib0"


def test_an_existing_launcher_is_read_from_torchrun_or_slurm_variables():
    assert launcher_env({}) is None
    assert launcher_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}) == \
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)"}
    assert launcher_env(slurm) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}


def _train(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run([sys.executable, "-m", "rackcast.cli", "train", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env=dict(full, **(env or {})))


def _one_line_exit_2(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_train_refuses_a_launch_whose_world_differs_from_the_plan_in_one_line(tmp_path):
    _one_line_exit_2(_train(EP_PLAN, "--out", str(tmp_path / "r"), "--nnodes", "2", "--nproc-per-node", "2",
                            "--rdzv-endpoint", "127.0.0.1:29400"), "needs 2 processes", "2 nodes x 2 = 4")


def test_train_under_a_launcher_with_another_world_size_says_so_in_one_line(tmp_path):
    _one_line_exit_2(_train(EP_PLAN, "--out", str(tmp_path / "r"), env={"RANK": "0", "WORLD_SIZE": "3"}),
                     "needs 2 processes", "started 3")
    other_rank = _train(EP_PLAN, "--out", str(tmp_path / "r"), env={"RANK": "1", "WORLD_SIZE": "3"})
    assert other_rank.returncode == 2 and other_rank.stderr == ""  # rank 0 says it once


def test_resume_without_a_checkpoint_says_so_and_exits_2(tmp_path):
    _one_line_exit_2(_train(EP_PLAN, "--out", str(tmp_path / "r"), "--resume"), "no complete checkpoint")


def test_a_worker_ends_when_its_launcher_is_killed(tmp_path):
    """A launcher (the parent) starts a worker that calls exit_with_parent, then dies of SIGKILL: the worker ends."""
    pid_file = tmp_path / "worker.pid"
    worker = textwrap.dedent(f"""
        import os, time
        from rackcast.backend.launch import exit_with_parent
        exit_with_parent()
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(120)
    """)
    launcher = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}]); time.sleep(120)"
    parent = subprocess.Popen([sys.executable, "-c", launcher])
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the worker did not start"
        time.sleep(0.1)
    child = int(pid_file.read_text())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    try:
        while _alive(child):
            assert time.monotonic() < deadline, "the worker outlived its launcher"
            time.sleep(0.1)
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_resume_with_another_plan_is_one_line_and_exit_2(tmp_path):
    from trainer_helpers import run_worker, write_plan

    first = write_plan(tmp_path / "a.yaml", {})
    done = run_worker(first, tmp_path / "run", 1)
    assert done.returncode == 0, done.stderr[-2000:]
    other = write_plan(tmp_path / "b.yaml", {}, seed=7)
    _one_line_exit_2(_train(str(other), "--out", str(tmp_path / "run"), "--resume", "--steps", "2"),
                     "b.yaml", "step-00000001", "train into another --out")


def test_the_two_node_recipe_plan_is_trainable_on_two_nodes_of_8():
    from rackcast.backend.parallel import validate_trainable
    from rackcast.plan import load_plan

    path = ROOT / "examples" / "multinode" / "ladder-d768-2node-h100.yaml"
    plan = load_plan(str(path))
    validate_trainable(plan, where=str(path))
    cmd = torchrun_command(str(path), plan.parallel.gpus, [], Nodes(nnodes=2, nproc_per_node=8,
                                                                    rdzv_endpoint="node0:29500"))
    assert _flag(cmd, "--nproc-per-node") == "8"
    for recipe in ("train-2node.sbatch", "torchrun-2node.sh"):
        assert "ladder-d768-2node-h100.yaml" in (ROOT / "examples" / "multinode" / recipe).read_text()


def test_forked_ranks_report_the_first_failure_and_stop_their_peers(tmp_path):
    """backend.forkrun (the tests' launcher): ranks are the trainer's own main, so a plan that does not exist is its
    one-line error and exit 2 from every rank, and the job returns that code rather than hanging."""
    from rackcast.backend.forkrun import fork_command

    cmd = fork_command(str(tmp_path / "missing.yaml"), 2, ["--steps", "1", "--out", str(tmp_path / "run")])
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert errors and all(line.startswith("rackcast train: error:") and "missing.yaml" in line for line in errors)


@pytest.mark.slow
def test_fork_server_jobs_get_their_own_environment_output_and_exit_code_and_time_out(tmp_path):
    """ForkServer runs each job in a child with the job's variables and its own captured output; a job past its
    timeout (here a rank told by RACKCAST_FAIL to stall) is killed with its ranks and reported as
    subprocess.TimeoutExpired, and the server serves the next job."""
    from rackcast.backend.forkrun import ForkServer
    from rackcast.backend.launch import worker_env

    server = ForkServer(worker_env(None, override=True), ROOT)
    try:
        missing = ["--plan", str(tmp_path / "missing.yaml"), "--steps", "1", "--out", str(tmp_path / "run")]
        done = server.run(2, missing, worker_env(None, override=True), ROOT, timeout=120)
        assert done.returncode == 2 and "missing.yaml: file not found" in done.stderr and done.stdout == ""
        stalled = tmp_path / "stalled"
        with pytest.raises(subprocess.TimeoutExpired):
            server.run(2, ["--plan", EP_PLAN, "--steps", "1", "--out", str(stalled), "--quiet"],
                       worker_env({"RACKCAST_FAIL": "1:0:stall"}, override=True), ROOT, timeout=15)
        deadline = time.monotonic() + 10  # SIGKILLed processes take a moment to go
        while _process_group(server.last_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _process_group(server.last_pid) == []
        done = server.run(1, missing, worker_env(None, override=True), ROOT, timeout=120)
        assert done.returncode == 2 and done.stderr.count("missing.yaml") == 1
    finally:
        server.close()


def _process_group(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (field 5 of /proc/PID/stat)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def test_forkrun_without_a_process_count_prints_usage_and_exits_2():
    from rackcast.backend.forkrun import main

    assert main([]) == 2 and main(["zero"]) == 2 and main(["0"]) == 2
