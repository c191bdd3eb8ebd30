"""Why the winner wins and why each rejected class of layout lost, in terms a person can check: memory per GPU against
HBM, the dominating phase of the step (pipeline bubble, exposed expert all-to-all, NIC-bound data-parallel
reduction, ...), the divisibility rule that refused it (the RackcastError text), and the deadline.

    from rackcast.planner.explain import explain_lines
    for line in explain_lines(result): print(line)
"""

from __future__ import annotations

import math
from collections import defaultdict

from rackcast.planner.report import distinct_label, fmt_days, varying_knobs
from rackcast.planner.rows import Row
from rackcast.planner.search import Result
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


def _gap(win: Row, row: Row, n: int = 2, simulated: bool = False) -> str:
    """The phases where `row` spends most more than the winner, per step of `row` (phases scaled per sequence, so
    different global batches compare), as 'pipeline bubble (+0.123 s per step) and ...'."""
    def phases(x: Row) -> dict[str, float]:
        p = (x.sim.get("phases_s") if simulated else None) or x.phases
        return {k: v / x.layout.global_batch for k, v in p.items()}

    a, b = phases(win), phases(row)
    diffs = sorted(((b.get(k, 0.0) - a.get(k, 0.0), k) for k in a), reverse=True)
    parts = [f"{PHASE_WORDS.get(k, k)} ({d * row.layout.global_batch:+.3g} s per step)" for d, k in diffs[:n] if d > 0]
    return " and ".join(parts)


def _mem(row: Row, hbm: float) -> str:
    return f"{row.memory.get('total', math.nan) / GIB:.3g} GiB per GPU of {hbm / GIB:.3g} GiB HBM"


def _named(row: Row, win: Row) -> str:
    """'#3 d11 f64 e64 capacity': the rank and the layout with every knob in which it differs from the winner."""
    return f"#{row.rank} {distinct_label(row.layout, varying_knobs([row.layout, win.layout]))}"


def versus_winner(result: Result, win: Row, row: Row) -> str:
    """One sentence: how much slower (or faster) `row` is than the winner, on which figures, and why."""
    both_sim = bool(win.sim and row.sim)
    w_rate = win.best_tokens_per_s if both_sim else win.tokens_per_s
    r_rate = row.best_tokens_per_s if both_sim else row.tokens_per_s
    slower = 100 * (w_rate / r_rate - 1)  # % more time per token than the winner
    basis = "simulated figures for both" if both_sim else "closed-form estimates for both"
    if win.sim and not row.sim:
        basis += f"; #{row.rank} was not simulated"
    why = _gap(win, row, simulated=both_sim)
    if slower >= 0.05:
        return (f"{_named(row, win)} is {slower:.1f}% slower than the winner ({basis})"
                + (f" because it spends more on {why}." if why else ", with the difference spread over every phase."))
    if slower > -0.05:
        return f"{_named(row, win)} is as fast as the winner to within 0.1% ({basis}); it ranks lower on a tie-break."
    note = ""
    if not row.sim and win.sim:
        band = 100 * result.request.band
        note = (f" It was not simulated: its estimate cannot beat the winner's simulated figure by more than the "
                f"estimate's {band:.0f}% error band, so the simulated rows rank first.")
    return f"{_named(row, win)} is {-slower:.1f}% faster than the winner ({basis})." + note


def explain_lines(result: Result, classes: int = 20) -> list[str]:
    r, win = result.request, result.winner
    hbm = result.hbm_bytes
    source = "simulated" if win.sim else "closed-form estimate"
    lines = [f"The winner is {win.layout.label}.",
             f"  It trains at {win.best_tokens_per_s / 1e6:.3f} M tokens/s (MFU {100 * win.best_mfu:.1f}%, {source}) "
             f"and needs {fmt_days(result.days_for(win))} days for {r.tokens:.3g} tokens.",
             f"  It holds {_mem(win, hbm)}, leaving {(hbm - win.memory['total']) / GIB:.3g} GiB free, with "
             f"recompute={win.layout.recompute} and the optimizer state in {win.layout.opt_location}.",
             f"  Its largest phase after compute is {dominating_phase(result, win)}."]
    if len(result.ranked) > 1:
        lines.append("  " + versus_winner(result, win, result.ranked[1]))
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
    lines.append("Ranked but slower (the best layout of each class of parallelism against the winner):")
    best_of: dict[str, Row] = {}
    for row in result.ranked:
        best_of.setdefault(row.layout.layout_class, row)
    others = sorted((row for cls, row in best_of.items() if row is not win), key=lambda x: x.rank)
    for row in others[:classes]:
        lines.append(f"  {row.layout.layout_class}: {versus_winner(result, win, row)} Its largest phase after "
                     f"compute is {dominating_phase(result, row, simulated=bool(row.sim))}.")
    return [line for line in lines if line]


def _deadline_line(result: Result) -> str:
    if math.isnan(result.available_days):
        return "  No deadline was given."
    win = result.winner
    missing = sum(1 for row in result.ranked if not result.meets_deadline(row))
    verdict = "meets" if result.meets_deadline(win) else "MISSES"
    return (f"  Against the deadline: the winner needs {fmt_days(result.days_for(win))} days of the "
            f"{result.available_days:.0f} "
            f"available ({result.request.start} to {result.request.deadline}), so it {verdict.lower()} it; "
            f"{missing} of {len(result.ranked)} ranked layouts miss it.")
