"""The trainer's single-process pieces: plan refusals, data sharding, capacity drops, checkpoint completeness,
the routing histogram the simulator replays.

    .venv/bin/pytest -q tests/test_trainer.py
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from rackcast.backend.checkpoint import MARKER, latest_complete, step_dir
from rackcast.backend.data import TokenData, prepare
from rackcast.backend.expert_parallel import pop_drop_counts, shard_experts
from rackcast.backend.model import build_model
from rackcast.backend.parallel import validate_trainable
from rackcast.backend.record import write_routing
from rackcast.errors import RackcastError
from rackcast.modelspec import MTPSpec
from rackcast.plan import ExpertTransport, load_plan
from rackcast.presets import load_model
from conftest import PLANS


@pytest.fixture(scope="module")
def data_folder(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("data"), max_bytes=2 << 20)


@pytest.mark.parametrize("field, plan_name, change", [
    ("parallel.tensor", "tiny-1proc", dict(tensor=2)),
    # context runs with multi-token prediction while each chunk holds MTP's lookahead (depth + 2 tokens): 128 / 64 not
    ("parallel.context", "tiny-deepseek-v3", dict(context=64)),
    ("parallel.expert_tensor", "tiny-2proc-tp-ep", dict(expert_tensor=2)),  # with tensor parallelism refused
])
def test_validate_trainable_refuses_unsupported_parallelism_naming_the_field(field, plan_name, change):
    plan = load_plan(PLANS / f"{plan_name}.yaml")
    with pytest.raises(RackcastError, match=field.replace(".", r"\.")):
        validate_trainable(replace(plan, parallel=replace(plan.parallel, **change)))


def test_validate_trainable_accepts_split_backward_schedules_with_experts_and_the_examples():
    """backend.pipeline gives every stage static shapes, so zb_h1 and dualpipev run with expert parallelism."""
    plan = load_plan(PLANS / "tiny-4proc.yaml")
    assert plan.parallel.expert > 1
    for schedule in ("zb_h1", "dualpipev"):
        validate_trainable(replace(plan, schedule=schedule, parallel=replace(plan.parallel, virtual=2)))
    for name in ("tiny-1proc", "tiny-2proc-ep", "tiny-2proc-pp", "tiny-4proc"):
        validate_trainable(load_plan(PLANS / f"{name}.yaml"))


def test_validate_trainable_accepts_mtp_and_tied_embeddings_on_pipelines_but_not_on_one_rank_s_v_shape():
    """backend.pipeline gives the last stage its own embedding copy; dualpipev's V puts the first and the last chunk
    on one rank (refused), and zb_h1 with tied embeddings and MTP together is refused."""
    plan = load_plan(PLANS / "tiny-2proc-pp.yaml")
    base = plan.model_spec()
    mtp, tied = replace(base, mtp=MTPSpec(depth=1)), replace(base, tied_embeddings=True)
    v_shaped = replace(plan, schedule="dualpipev", parallel=replace(plan.parallel, virtual=2))
    zero_bubble = replace(plan, schedule="zb_h1", parallel=replace(plan.parallel, virtual=2))
    for spec in (mtp, tied):
        validate_trainable(replace(plan, model=spec))
        validate_trainable(replace(zero_bubble, model=spec))
        with pytest.raises(RackcastError, match=r"schedule: dualpipev .*first and the last chunk on one rank"):
            validate_trainable(replace(v_shaped, model=spec))
    validate_trainable(v_shaped)
    with pytest.raises(RackcastError, match=r"schedule: zb_h1 with tied embeddings and multi-token prediction"):
        validate_trainable(replace(zero_bubble, model=replace(mtp, tied_embeddings=True)))


def test_data_ranks_take_contiguous_shares_that_never_overlap_and_together_equal_one_process(data_folder):
    data = TokenData(data_folder, "train", 128, seed=3)
    whole = data.batch(5, 8)
    parts = [data.batch(5, 8, rank=r, ranks=4) for r in range(4)]
    assert all(p.shape == (2, 128) for p in parts)
    rebuilt = np.concatenate(parts)  # rank r's micro-batches are one process's micro-batches of its share
    assert np.array_equal(rebuilt, whole)
    rows = {row.tobytes() for p in parts for row in p}
    assert len(rows) == 8


def test_data_is_deterministic_by_seed_and_eval_split_is_separate(data_folder):
    a, b = TokenData(data_folder, "train", 64, seed=1), TokenData(data_folder, "train", 64, seed=1)
    c = TokenData(data_folder, "train", 64, seed=2)
    assert np.array_equal(a.batch(0, 4), b.batch(0, 4))
    assert not np.array_equal(a.batch(0, 4), c.batch(0, 4))
    manifest = json.loads((data_folder / "manifest.json").read_text())
    assert manifest["shards"]["eval"]["tokens"] > 0 and manifest["vocab"] == 256
    assert TokenData(data_folder, "eval", 64).batch(0, 2).max() < 256


def test_capacity_mode_drops_and_counts_assignments_beyond_capacity():
    spec = load_model("tiny-moe")
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    reference = build_model(spec, seed=0)(x)
    roomy = build_model(spec, seed=0)
    moes = shard_experts(roomy, None, 0, 1, capacity_factor=float(spec.moe.experts))
    assert torch.allclose(roomy(x), reference, atol=1e-6)
    assert pop_drop_counts(moes)[0] == 0
    tight = build_model(spec, seed=0)
    moes = shard_experts(tight, None, 0, 1, capacity_factor=0.5)
    tight(x)
    dropped, assigned = pop_drop_counts(moes)
    assert assigned == 128 * spec.moe.top_k * len(moes)
    assert dropped >= assigned // 2  # at most half of the slots exist


def test_a_checkpoint_without_its_completion_marker_is_not_resumed_from(tmp_path):
    for step in (2, 4):
        step_dir(tmp_path, step).mkdir(parents=True)
        (step_dir(tmp_path, step) / "__0_0.distcp").write_bytes(b"x")
    (step_dir(tmp_path, 2) / MARKER).write_text("{}")
    (tmp_path / "checkpoints" / ".tmp-step-00000006").mkdir()
    assert latest_complete(tmp_path) == step_dir(tmp_path, 2)


def test_routing_histogram_is_replayed_by_the_simulator(tmp_path):
    from rackcast.simulator.routing import expert_probabilities

    write_routing(tmp_path, {0: [30, 10, 0, 0], 1: [10, 30, 0, 20]})
    transport = ExpertTransport(routing="histogram", histogram=str(tmp_path / "routing.parquet"))
    probs = expert_probabilities(transport, 4)
    assert np.allclose(probs, [40 / 100, 40 / 100, 0, 20 / 100])


def _row(step: int, time_s: float, peak: float, profiled: bool = False) -> dict:
    from rackcast.vocab import MEASURED_PHASES as PHASES

    return {"step": step, "loss": 1.0, "eval_loss": math.nan, "step_time_s": time_s, "tokens_per_s": 1 / time_s,
            "mfu": 0.1, "step_cpu_s": time_s / 2, "core_share": 0.5, **{f"phase_{p}_s": 0.0 for p in PHASES}, "peak_memory_bytes": peak,
            "peak_rss_bytes": 500, "drop_fraction": 0.0, "memory_profiled": profiled}


def test_summary_medians_skip_warm_up_and_the_memory_profiled_step():
    from rackcast.backend.record import summary

    rows = [_row(1, 9.0, math.nan), _row(2, 1.0, math.nan), _row(3, 5.0, 120, profiled=True), _row(4, 1.0, 120),
            _row(5, 2.0, 120)]
    out = summary(rows)
    assert out["step_time_s"] == 1.0  # median of steps 2, 4, 5
    assert out["peak_memory_bytes"] == 120 and out["peak_rss_bytes"] == 500
    assert summary([rows[0], rows[2]])["step_time_s"] == 5.0  # nothing else after warm-up: the profiled step counts


def test_step_row_means_cpu_time_over_ranks_and_reads_phases_after_it():
    """step_row: the step's CPU seconds are averaged over ranks and divided by the mean wall step (core_share), the
    speed probe averaged with its slowest rank's beside it; the phase columns start after the probe column, and the
    slowest rank is picked by wall time."""
    from rackcast.backend.record import PHASE_COLUMN, step_row
    from rackcast.vocab import MEASURED_PHASES

    names = list(MEASURED_PHASES)
    per_rank = torch.zeros(2, PHASE_COLUMN + len(names), dtype=torch.float64)
    #                  loss ce   z  mbs drop assigned wall cpu probe
    per_rank[0, :PHASE_COLUMN] = torch.tensor([4.0, 4.0, 0, 2, 0, 10, 2.0, 1.0, 0.25])
    per_rank[1, :PHASE_COLUMN] = torch.tensor([4.0, 4.0, 0, 2, 0, 10, 4.0, 2.0, 0.75])
    per_rank[0, PHASE_COLUMN + names.index("compute")] = 1.5
    per_rank[1, PHASE_COLUMN + names.index("compute")] = 3.5
    row = step_row(per_rank, torch.tensor([1.0, 2.0]), names, tokens_per_step=100, model_flops=1e9,
                   peak_flops=1e9, pipeline=False)
    assert row["step_time_s"] == 3.0 and row["step_cpu_s"] == 1.5 and row["core_share"] == 0.5
    assert row["phase_compute_s"] == 2.5 and row["phase_compute_slowest_s"] == 3.5 and row["slowest_rank"] == 1
    assert row["loss"] == 2.0
    assert row["probe_s"] == 0.5 and row["probe_slowest_s"] == 0.75


@pytest.mark.slow
def test_one_process_run_records_the_profiled_live_tensor_peak(tmp_path):
    """The CPU record carries the profiler's peak live tensor bytes, the RSS beside it, and says how and in what
    dtype; the measured peak is above the fused fp32 memory model (the eager backend keeps more) and within 5% of its
    eager count (simulator.activations)."""
    import pyarrow.parquet as pq

    from rackcast.simulator.memory import memory_breakdown
    from trainer_helpers import run_worker, write_plan

    plan_path = write_plan(tmp_path / "p.yaml", {}, global_batch=4, micro_batch=2)
    result = run_worker(plan_path, tmp_path / "run", 4)
    assert result.returncode == 0, result.stderr[-3000:]
    # the profiled step is quiet in the launcher's worker environment (backend.launch.QUIET_PROFILER_ENV)
    assert "USDT" not in result.stderr and "CPUAllocator" not in result.stderr, result.stderr[-2000:]
    record = json.loads((tmp_path / "run" / "record.json").read_text())
    assert record["memory_measure"] == "torch profiler live tensor bytes"
    assert record["param_dtype"] == "fp32" and record["activation_dtype"] == "fp32"
    plan = load_plan(plan_path)
    fused = memory_breakdown(plan.model_spec(), plan, dtype="fp32").total
    eager = memory_breakdown(plan.model_spec(), plan, dtype="fp32", activations="eager").total
    assert fused < record["peak_memory_bytes"] == pytest.approx(eager, rel=0.05)
    assert record["peak_memory_per_rank_bytes"] == [record["peak_memory_bytes"]]
    assert record["peak_rss_bytes"] > 2 * record["peak_memory_bytes"]  # the runtime's share
    rows = pq.read_table(tmp_path / "run" / "metrics.parquet").to_pydict()
    assert all(c > 0 for c in rows["step_cpu_s"]) and record["step_cpu_s"] > 0
    assert rows["core_share"] == pytest.approx([c / w for c, w in zip(rows["step_cpu_s"], rows["step_time_s"])])
    assert rows["memory_profiled"] == [False, False, True, False]
    assert math.isnan(rows["peak_memory_bytes"][1]) and rows["peak_memory_bytes"][2] == record["peak_memory_bytes"]
