"""Pipeline schedules: orders match torch.distributed.pipelining, execution matches the closed forms.

Run: .venv/bin/pytest -q tests/test_schedules.py
"""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from rackcast.simulator import schedule_formulas as formulas
from rackcast.simulator.pipeline_exec import ChunkDurations, run_pipeline
from rackcast.simulator.schedules import SCHEDULE_NAMES, Action, pipeline_orders, stage_to_rank

REPO = Path(__file__).resolve().parents[1]

# (schedule, virtual, stage durations): backward = 2 x forward; zero-bubble variants split it into B = W = F.
UNIFORM = [
    ("gpipe", 1, ChunkDurations(1.0, 1.0, 1.0)),
    ("1f1b", 1, ChunkDurations(1.0, 1.0, 1.0)),
    ("interleaved_1f1b", 2, ChunkDurations(0.5, 0.5, 0.5)),
    ("interleaved_1f1b", 4, ChunkDurations(0.25, 0.25, 0.25)),
    ("zb_h1", 1, ChunkDurations(1.0, 1.0, 1.0)),
    ("zbv", 2, ChunkDurations(0.5, 0.5, 0.5)),
    ("dualpipev", 2, ChunkDurations(0.5, 0.5, 0.5)),
]
SHAPES = [(2, 4), (4, 8), (4, 16), (8, 16), (8, 32)]  # (stages, microbatches): m a multiple of p, m >= 2p


@pytest.mark.parametrize("name,virtual,durations", UNIFORM, ids=[f"{n}-v{v}" for n, v, _ in UNIFORM])
@pytest.mark.parametrize("stages,microbatches", SHAPES)
def test_simulated_bubble_matches_closed_form(name, virtual, durations, stages, microbatches):
    res = run_pipeline(name, stages, microbatches, virtual, durations, p2p_latency_s=0.0)
    times = (durations.forward_s, durations.backward_input_s, durations.backward_weight_s)
    expected = formulas.bubble_fraction(name, stages, microbatches, virtual, *times)
    assert res.bubble_fraction == pytest.approx(expected, rel=0.01)
    per_rank_idle = formulas.bubble_time_s(name, stages, microbatches, virtual, *times)
    assert all(idle == pytest.approx(per_rank_idle, abs=1e-9) for idle in res.idle_s)


@pytest.mark.parametrize("stages,microbatches", SHAPES)
def test_textbook_bubble_fractions(stages, microbatches):
    p, m = stages, microbatches
    assert formulas.bubble_fraction("gpipe", p, m) == pytest.approx((p - 1) / (m + p - 1))
    assert formulas.bubble_fraction("1f1b", p, m) == pytest.approx((p - 1) / (m + p - 1))
    assert formulas.bubble_fraction("interleaved_1f1b", p, m, 2) == pytest.approx((p - 1) / (2 * m + p - 1))
    # ZB-H1 with F = B = W: a third of 1F1B's bubble time (Qi et al. 2023).
    assert formulas.bubble_time_s("zb_h1", p, m) == pytest.approx(formulas.bubble_time_s("1f1b", p, m) / 3)


@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8), (4, 10), (8, 20)])
def test_dualpipev_with_fuse_pairs_matches_deepseek_readme_bubble(stages, microbatches):
    # README: (PP/2 - 1)(F&B + B - 3W) with PP = 2 x stages, B a full backward, F&B taken as F + B.
    f = b = w = 1.0
    res = run_pipeline("dualpipev", stages, microbatches, 2, ChunkDurations(f, b, w), fuse_pairs=True)
    readme_idle = (2 * stages / 2 - 1) * ((f + b + w) + (b + w) - 3 * w)
    assert all(idle == pytest.approx(readme_idle) for idle in res.idle_s)
    assert res.bubble_fraction == pytest.approx(
        formulas.bubble_fraction("dualpipev", stages, microbatches, 2, fuse_pairs=True), rel=0.01
    )


def test_zb_h1_bubble_with_unequal_split_matches_paper_form():
    # Qi et al. 2023: ZB-H1 idles (p-1)(T_F + T_B - T_W) per rank.
    d = ChunkDurations(3.0, 2.0, 1.0)
    res = run_pipeline("zb_h1", 4, 12, 1, d)
    assert all(idle == pytest.approx(3 * (3.0 + 2.0 - 1.0)) for idle in res.idle_s)


@pytest.mark.parametrize("stages,microbatches", SHAPES)
@pytest.mark.parametrize("virtual", [2, 4])
def test_interleaved_bubble_with_heavier_end_chunks_matches_the_paced_form(stages, microbatches, virtual):
    # The embedding makes chunk 0 slower and the output head the last chunk slower still, so the last rank sets the
    # steady state while its first chunk is a light one: it idles the first round at chunk 0's forward pace and the
    # cool-down runs at chunk 0's backward pace (schedule_formulas.paced_bubble_time_s), which the uniform form misses.
    base, embed, head = ChunkDurations(1.0, 1.0, 1.0), ChunkDurations(2.5, 2.0, 2.0), ChunkDurations(4.0, 3.0, 3.0)
    chunks = [embed] + [base] * (stages * virtual - 2) + [head]
    res = run_pipeline("interleaved_1f1b", stages, microbatches, virtual, chunks)
    assert max(res.busy_s) == res.busy_s[-1]
    first = chunks[:stages]  # rank r runs chunk r first
    units = lambda d: (d.forward_s, d.backward_input_s, d.backward_weight_s)  # noqa: E731
    chain = tuple(sum(units(d)[i] for d in first[:-1]) / (stages - 1) for i in range(3))
    idle = formulas.paced_bubble_time_s(
        formulas.bubble_coefficients("interleaved_1f1b", stages, microbatches, virtual),
        formulas.pacing_coefficients("interleaved_1f1b", stages, microbatches, virtual), chain, units(first[-1]),
        units(embed))
    assert res.total_s - res.busy_s[-1] == pytest.approx(idle)
    assert idle > formulas.bubble_time_s("interleaved_1f1b", stages, microbatches, virtual, *chain)


def test_paced_form_reduces_to_the_uniform_form_for_equal_first_chunks():
    for name in ("interleaved_1f1b", "zb_h1"):
        units = (1.0, 0.75, 0.5)
        idle = formulas.paced_bubble_time_s(formulas.bubble_coefficients(name, 4, 8, 2),
                                            formulas.pacing_coefficients(name, 4, 8, 2), units, units, units)
        assert idle == pytest.approx(formulas.bubble_time_s(name, 4, 8, 2, *units))


KNOWN_PEAKS = [
    # (schedule, stages, microbatches, virtual, peak on rank 0 in chunk-microbatches)
    ("gpipe", 4, 8, 1, 8),  # all m
    ("1f1b", 4, 8, 1, 4),  # p
    ("1f1b", 8, 32, 1, 8),
    ("interleaved_1f1b", 4, 8, 2, 11),  # (v-1)p + 2(p-1) + 1 (Megatron warm-up)
    ("interleaved_1f1b", 4, 16, 4, 19),
    ("zb_h1", 4, 8, 1, 4),  # p, as 1F1B
    ("zb_h1", 8, 32, 1, 8),
    ("zbv", 4, 8, 2, 8),  # 2p chunks = p stages, as 1F1B
    ("dualpipev", 4, 8, 2, 9),  # 2p + 1 = PP + 1 chunks
    ("dualpipev", 8, 32, 2, 17),
]


@pytest.mark.parametrize("name,stages,microbatches,virtual,peak", KNOWN_PEAKS)
def test_peak_in_flight_matches_known_count(name, stages, microbatches, virtual, peak):
    res = run_pipeline(name, stages, microbatches, virtual, ChunkDurations.uniform(1.0))
    assert res.peak_in_flight[0] == peak
    assert max(res.peak_in_flight) == peak
    assert list(res.peak_in_flight) == [
        formulas.peak_in_flight(name, stages, microbatches, virtual, r) for r in range(stages)
    ]


def test_one_f_one_b_in_flight_falls_by_one_per_rank():
    res = run_pipeline("1f1b", 5, 10, 1, ChunkDurations.uniform(1.0))
    assert res.peak_in_flight == (5, 4, 3, 2, 1)


# --- torch.distributed.pipelining agreement ---

TORCH_KIND = {"F": "F", "I": "B", "W": "W", "B": "BW"}


def _stub_stage(index: int, num_stages: int, group_size: int) -> types.SimpleNamespace:
    # Schedule constructors only read these attributes; no process group or module is needed to get the order.
    return types.SimpleNamespace(
        stage_index=index, num_stages=num_stages, group_size=group_size, group_rank=0, submod=None,
        is_first=index == 0, is_last=index == num_stages - 1, stage_index_to_group_rank=None,
    )


def _torch_schedule(name, stages, microbatches, virtual):
    sch = pytest.importorskip("torch.distributed.pipelining.schedules")
    n = stages * virtual
    if name == "interleaved_1f1b":
        return sch.ScheduleInterleaved1F1B([_stub_stage(i * stages, n, stages) for i in range(virtual)], microbatches)
    if name == "zb_h1":
        return sch.ScheduleInterleavedZeroBubble(
            [_stub_stage(i * stages, n, stages) for i in range(virtual)], microbatches
        )
    cls = {"zbv": sch.ScheduleZBVZeroBubble, "dualpipev": sch.ScheduleDualPipeV}[name]
    return cls([_stub_stage(0, n, stages), _stub_stage(n - 1, n, stages)], microbatches)


def _compute_only(actions) -> list[tuple[str, int, int]]:
    out = []
    for a in actions:
        if a is None:
            continue
        for sub in a.sub_actions or (a,):  # OVERLAP_F_B runs its parts in order
            kind = TORCH_KIND.get(sub.computation_type.value)
            if kind is not None:
                out.append((kind, sub.microbatch_index, sub.stage_index))
    return out


def _ours(name, stages, microbatches, virtual):
    orders = pipeline_orders(name, stages, microbatches, virtual)
    return [[(a.kind, a.microbatch, a.stage) for a in ops] for ops in orders]


MULTI_CASES = [
    ("interleaved_1f1b", 2, 4, 2), ("interleaved_1f1b", 4, 8, 2), ("interleaved_1f1b", 4, 12, 3),
    ("interleaved_1f1b", 4, 10, 2), ("interleaved_1f1b", 8, 16, 4), ("interleaved_1f1b", 4, 3, 2),
    ("zb_h1", 2, 4, 1), ("zb_h1", 4, 8, 1), ("zb_h1", 8, 24, 1), ("zb_h1", 4, 8, 2), ("zb_h1", 4, 12, 3),
    ("zbv", 2, 4, 2), ("zbv", 4, 8, 2), ("zbv", 4, 5, 2), ("zbv", 8, 24, 2),
    ("dualpipev", 2, 4, 2), ("dualpipev", 4, 8, 2), ("dualpipev", 4, 11, 2), ("dualpipev", 8, 32, 2),
]


@pytest.mark.parametrize("name,stages,microbatches,virtual", MULTI_CASES)
def test_order_equals_torch_pipeline_order(name, stages, microbatches, virtual):
    torch_sched = _torch_schedule(name, stages, microbatches, virtual)
    ours = _ours(name, stages, microbatches, virtual)
    assert [_compute_only(torch_sched.pipeline_order[r]) for r in range(stages)] == ours
    # What the runtime iterates over: the lowered order with sends, receives and grad reductions added.
    assert [_compute_only(torch_sched.pipeline_order_with_comms[r]) for r in range(stages)] == ours


def test_chunk_placement_matches_torch():
    utils = pytest.importorskip("torch.distributed.pipelining._utils")
    for name, style in (("interleaved_1f1b", "loop"), ("dualpipev", "v")):
        mapping = utils.generate_stage_to_rank_mapping(4, 8, style=style)
        assert stage_to_rank(name, 4, 2) == [mapping[c] for c in range(8)]


class _RecordingStage:
    """Single-stage schedules run from _step_microbatches; record the compute calls it makes."""

    def __init__(self, index: int, stages: int):
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, stages, index
        self.submod, self.is_first, self.is_last = None, index == 0, index == stages - 1
        self.log: list[tuple[str, int, int]] = []

    def get_fwd_recv_ops(self, i):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, i, *args, **kwargs):
        self.log.append(("F", i, self.stage_index))

    def backward_one_chunk(self, i, **kwargs):
        self.log.append(("BW", i, self.stage_index))

    def perform_reduce_grad(self, *args):
        pass

    def clear_runtime_states(self):
        pass


def _torch_executed_single(name, stages, microbatches):
    sch = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = {"gpipe": sch.ScheduleGPipe, "1f1b": sch.Schedule1F1B}[name]
    orders, declared = [], []
    for rank in range(stages):
        stage = _RecordingStage(rank, stages)
        schedule = cls(stage, microbatches)
        schedule._initialize_stage = lambda *a, **k: None  # no process group: skip the shape handshake
        schedule._step_microbatches([()] * microbatches, [{}] * microbatches)
        orders.append(stage.log)
        declared.append(_compute_only(schedule.pipeline_order[rank]))
    return orders, declared


@pytest.mark.parametrize("name,stages,microbatches", [
    ("gpipe", 1, 3), ("gpipe", 4, 2), ("gpipe", 4, 8), ("1f1b", 2, 2), ("1f1b", 4, 8), ("1f1b", 8, 13),
])
def test_single_stage_order_equals_what_torch_executes(name, stages, microbatches):
    executed, declared = _torch_executed_single(name, stages, microbatches)
    ours = _ours(name, stages, microbatches, 1)
    assert executed == ours
    if name == "gpipe":
        assert declared == ours
    else:
        # torch 2.13's Schedule1F1B.pipeline_order agrees except on the last rank, where it numbers forwards
        # from 1 (F1..Fm) although _step_microbatches runs F0..F(m-1).
        assert declared[:-1] == ours[:-1]
        assert declared[-1] == [(k, mb + 1 if k == "F" else mb, s) for k, mb, s in ours[-1]]


@pytest.mark.parametrize("name,stages,microbatches,virtual,match", [
    ("1f1b", 4, 3, 1, "microbatches >= stages"),
    ("dualpipev", 4, 6, 2, r"microbatches >= model chunks"),
    ("interleaved_1f1b", 4, 10, 3, None),  # valid: 10 % max(1, 10 // 4) == 0
    ("interleaved_1f1b", 4, 9, 2, "multiple of the number of rounds"),
    ("zb_h1", 4, 13, 1, "multiple of the number of rounds"),
    ("gpipe", 4, 8, 2, "virtual must be 1"),
    ("dualpipev", 4, 8, 3, "virtual must be 2"),
    ("zbv", 4, 8, 1, "virtual must be 2"),
    ("1f1b", 0, 8, 1, "stages must be a positive integer"),
    ("pipedream", 4, 8, 1, "unknown pipeline schedule"),
])
def test_invalid_combinations_raise_clear_value_error(name, stages, microbatches, virtual, match):
    if match is None:
        pipeline_orders(name, stages, microbatches, virtual)
        return
    with pytest.raises(ValueError, match=match):
        pipeline_orders(name, stages, microbatches, virtual)
    with pytest.raises(ValueError, match=match):
        run_pipeline(name, stages, microbatches, virtual, ChunkDurations.uniform(1.0))


@pytest.mark.parametrize("name,stages,microbatches,virtual", [
    ("1f1b", 4, 3, 1), ("dualpipev", 4, 6, 2), ("interleaved_1f1b", 4, 9, 2), ("zb_h1", 4, 13, 1),
])
def test_torch_rejects_the_same_combinations(name, stages, microbatches, virtual):
    sch = pytest.importorskip("torch.distributed.pipelining.schedules")
    with pytest.raises(ValueError):
        if name == "1f1b":
            sch.Schedule1F1B(_stub_stage(0, stages, stages), microbatches)
        else:
            _torch_schedule(name, stages, microbatches, virtual)


# --- executor behaviour ---


def test_every_action_starts_after_its_inputs_arrive_and_ranks_run_one_at_a_time():
    latency = 0.25
    for name, virtual, durations in UNIFORM:
        res = run_pipeline(name, 4, 8, virtual, ChunkDurations(1.0, 0.7, 0.4), p2p_latency_s=latency)
        owner = stage_to_rank(name, 4, virtual)
        end = {}
        for tl in res.timelines:
            for e in tl:
                end[(e.action.kind, e.action.stage, e.action.microbatch)] = e.end_s
        last = 4 * virtual - 1
        for rank, tl in enumerate(res.timelines):
            for prev, cur in zip(tl, tl[1:]):
                assert cur.start_s >= prev.end_s - 1e-12
            for e in tl:
                a = e.action
                needs = []
                if a.kind == "F" and a.stage > 0:
                    needs.append(("F", a.stage - 1))
                if a.kind in ("B", "BW"):
                    needs.append(("F", a.stage))
                    if a.stage < last:
                        needs.append(("B" if ("B", a.stage + 1, a.microbatch) in end else "BW", a.stage + 1))
                if a.kind == "W":
                    needs.append(("B", a.stage))
                for kind, stage in needs:
                    lag = latency if owner[stage] != rank else 0.0
                    assert e.start_s >= end[(kind, stage, a.microbatch)] + lag - 1e-12, (name, a)


def test_p2p_latency_adds_one_latency_per_hop_each_way_to_gpipe():
    p, lat = 4, 0.1
    base = run_pipeline("gpipe", p, 8, 1, ChunkDurations.uniform(1.0))
    slow = run_pipeline("gpipe", p, 8, 1, ChunkDurations.uniform(1.0), p2p_latency_s=lat)
    assert slow.total_s == pytest.approx(base.total_s + 2 * (p - 1) * lat)
    # 1F1B has no slack in its steady state, so latency also stretches every backward/forward exchange.
    base = run_pipeline("1f1b", p, 8, 1, ChunkDurations.uniform(1.0))
    slow = run_pipeline("1f1b", p, 8, 1, ChunkDurations.uniform(1.0), p2p_latency_s=lat)
    assert slow.total_s > base.total_s + 2 * (p - 1) * lat


def test_per_chunk_durations_slow_stage_sets_the_pace():
    fast, slow = ChunkDurations(1.0, 1.0, 1.0), ChunkDurations(2.0, 2.0, 2.0)
    res = run_pipeline("1f1b", 4, 16, 1, [fast, fast, slow, fast])
    assert res.total_s >= 16 * 6.0
    assert res.busy_s[2] == pytest.approx(16 * 6.0)


def test_run_is_deterministic():
    args = ("dualpipev", 4, 12, 2, ChunkDurations(1.0, 0.8, 0.6), 0.05)
    assert run_pipeline(*args) == run_pipeline(*args)


def test_sixteen_stages_sixty_four_microbatches_finish_no_sooner_than_the_work():
    """A large pipeline runs to the end under every schedule (timing is benchmarks/bench_step_sim.py's job)."""
    for name, virtual in (("1f1b", 1), ("interleaved_1f1b", 2), ("dualpipev", 2)):
        result = run_pipeline(name, 16, 64, virtual, ChunkDurations.uniform(1.0), p2p_latency_s=1e-3)
        assert result == run_pipeline(name, 16, 64, virtual, ChunkDurations.uniform(1.0), p2p_latency_s=1e-3)


def test_every_schedule_covers_every_chunk_and_microbatch_once_per_kind():
    for name in SCHEDULE_NAMES:
        virtual = 2 if name in ("interleaved_1f1b", "zbv", "dualpipev") else 1
        orders = pipeline_orders(name, 4, 8, virtual)
        flat = [a for ops in orders for a in ops]
        assert len(flat) == len(set(flat))
        for c in range(4 * virtual):
            for mb in range(8):
                assert Action("F", mb, c) in flat
                assert (Action("BW", mb, c) in flat) != (Action("B", mb, c) in flat and Action("W", mb, c) in flat)


def test_simulator_schedules_does_not_import_torch():
    code = (
        "import sys; import simulator.schedules, simulator.schedule_formulas, simulator.pipeline_exec; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_pacing_is_only_for_two_or_more_chunks_per_rank():
    # the first-chunk pacing's derivation needs v >= 2 (schedule_formulas docstring); at v = 1 the first chunk is the
    # whole stage, priced by the uniform form
    for name in ("interleaved_1f1b", "zb_h1"):
        assert formulas.pacing_coefficients(name, 4, 8, 1) == (0, 0)
    assert formulas.pacing_coefficients("interleaved_1f1b", 4, 8, 2) == (3, 3)
    assert formulas.pacing_coefficients("zb_h1", 4, 8, 2) == (3, 0)
