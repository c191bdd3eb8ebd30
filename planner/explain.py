"""Why the winner wins and why each rejected class of layout lost, in terms a person can check: memory per GPU against
HBM, the dominating phase of the step (pipeline bubble, exposed expert all-to-all, NIC-bound data-parallel
reduction, ...), the divisibility rule that refused it (the RackcastError text), and the deadline.

    from rackcast.planner.explain import explain_lines
    for line in explain_lines(result): print(line)
"""

from __future__ import annotations

import math
from collections import defaultdict

from rackcast.planner.search import Result, Row
from rackcast.simulator.placement import place
from rackcast.units import GIB
PHASE_WORDS = {
    "compute": "compute",
    "exposed_expert_a2a": "exposed expert all-to-all",
    "exposed_tensor_comm": "exposed tensor/context-parallel communication",
    "exposed_fsdp_gather": "exposed FSDP weight gathers",
    "pipeline_p2p": "pipeline send/receive",
    "pipeline_bubble": "pipeline bubble",
    "exposed_dp_comm": "exposed data-parallel gradient reduction",
    "optimizer": "optimizer step",
    "host_transfer": "host-memory optimizer transfers",
}


def _per_token(row: Row) -> dict[str, float]:
    """Closed-form phase seconds per sequence of the global batch, so layouts with different global batches
    compare, and a simulated winner is not compared with closed-form figures of the others."""
    return {k: v / row.layout.global_batch for k, v in row.phases.items()}


def dominating_phase(result: Result, row: Row, simulated: bool = True) -> str:
    """The largest phase other than compute, with its seconds and what its group crosses."""
    phases = (row.sim.get("phases_s") if simulated else None) or row.phases
    name, secs = max(((k, v) for k, v in phases.items() if k != "compute"), key=lambda kv: (kv[1], kv[0]))
    step = row.sim.get("step_time_s", row.step_time_s) if simulated and row.sim else row.step_time_s
    words = PHASE_WORDS.get(name, name)
    if name == "exposed_dp_comm" or name == "exposed_expert_a2a":
        pl = place(result.plan_for(row), row.layout.usable)
        group = pl.data if name == "exposed_dp_comm" and row.layout.parallel.data > 1 else \
            pl.dense_replicas if name == "exposed_dp_comm" else pl.expert
        if group.span == "scale_out":
            words += f" (NIC-bound: the group spans {group.domains} {result.topo.domain_label}s)"
    return f"{words} {secs:.3f} s of a {step:.3f} s step ({100 * secs / step:.0f}%)"


def _gap(win: Row, row: Row, n: int = 2) -> str:
    """The phases where `row` loses most time against the winner, per step of `row` at the winner's speed."""
    a, b = _per_token(win), _per_token(row)
    diffs = sorted(((b.get(k, 0.0) - a.get(k, 0.0), k) for k in a), reverse=True)
    return ", ".join(f"{PHASE_WORDS.get(k, k)} +{d * row.layout.global_batch:.3f} s per step"
                     for d, k in diffs[:n] if d > 0)


def _mem(row: Row, hbm: float) -> str:
    return f"{row.memory.get('total', math.nan) / GIB:.1f} GiB per GPU of {hbm / GIB:.1f} GiB HBM"


def explain_lines(result: Result, classes: int = 20) -> list[str]:
    r, win = result.request, result.winner
    hbm = result.hbm_bytes
    lines = [f"Winner: {win.layout.label}",
             f"  {win.best_tokens_per_s / 1e6:.3f} M tokens/s, MFU {100 * win.best_mfu:.1f}%, "
             f"{result.days_for(win):.1f} days to {r.tokens:.3g} tokens ({'simulated' if win.sim else 'closed-form'})",
             f"  memory: {_mem(win, hbm)} (headroom {(hbm - win.memory['total']) / GIB:.1f} GiB); "
             f"recompute={win.layout.recompute}, optimizer state in {win.layout.opt_location}",
             f"  largest non-compute phase: {dominating_phase(result, win)}"]
    if len(result.ranked) > 1:
        second = result.ranked[1]
        worse = _gap(win, second)
        gap = 100 * (win.best_tokens_per_s / second.best_tokens_per_s - 1)
        lines.append(f"  beats #2 ({second.layout.label}) by {gap:.2f}% tokens/s"
                     f" ({'simulated' if win.sim and second.sim else 'closed-form'})"
                     + (f"; #2 spends more on {worse}" if worse else ""))
    lines.append(_deadline_line(result))
    lines.append("Rejected by divisibility (rackcast.plan.validate; one example per rule):")
    by_rule: dict[str, list[Row]] = defaultdict(list)
    for row in result.rows:
        if row.status == "invalid":
            by_rule[row.reason.split(":")[0]].append(row)
    for rule in sorted(by_rule):
        rows = sorted(by_rule[rule], key=lambda x: (x.layout.label, x.reason))
        lines.append(f"  {rule}: {len(rows)} layouts, e.g. {rows[0].layout.parallel_label}: {rows[0].reason}")
    lines.append("  not enumerated: tensor x context groups that would not divide the GPUs of one "
                 f"{result.topo.domain_label} (they would cross the NVLink domain)")
    lines.append("Rejected by memory (the leanest layout of each class, after recomputation and host offload):")
    by_class: dict[str, list[Row]] = defaultdict(list)
    for row in result.rows:
        if row.status == "no_fit":
            by_class[row.layout.layout_class].append(row)
    for cls in sorted(by_class, key=lambda c: (-len(by_class[c]), c))[:classes]:
        lean = min(by_class[cls], key=lambda x: (x.memory["total"], x.layout.label))
        lines.append(f"  {cls}: {len(by_class[cls])} layouts; leanest {lean.layout.parallel_label} "
                     f"({lean.layout.knobs_label}): {lean.reason}")
    lines.append("Ranked but slower (the best layout of each class against the winner, closed-form figures for both):")
    best_of: dict[str, Row] = {}
    for row in result.ranked:
        best_of.setdefault(row.layout.layout_class, row)
    others = sorted((row for cls, row in best_of.items() if row is not win), key=lambda x: x.rank)
    for row in others[:classes]:
        gap = 100 * (1 - row.tokens_per_s / win.tokens_per_s)
        worse = _gap(win, row)
        lines.append(f"  {row.layout.layout_class}: best #{row.rank} {row.layout.parallel_label} is {gap:.1f}% "
                     f"slower" + (f" (more {worse})" if worse else "") + f"; its largest non-compute phase: "
                     f"{dominating_phase(result, row, simulated=False)}")
    return [line for line in lines if line]


def _deadline_line(result: Result) -> str:
    if math.isnan(result.available_days):
        return "  deadline: none given"
    win = result.winner
    missing = sum(1 for row in result.ranked if not result.meets_deadline(row))
    verdict = "meets" if result.meets_deadline(win) else "MISSES"
    return (f"  deadline: {result.days_for(win):.1f} days against {result.available_days:.0f} available "
            f"({result.request.start} to {result.request.deadline}): the winner {verdict} it; "
            f"{missing} of {len(result.ranked)} ranked layouts miss it")
