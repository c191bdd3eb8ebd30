"""Output of a layout search: the ranked rich table, JSON, every candidate as Parquet, and the winner as a plan file.

    from rackcast.planner.report import ranked_table, write_parquet, write_best_plan
"""

from __future__ import annotations

import math
from pathlib import Path

from rich.table import Table

from rackcast.atomic import atomic_path
from rackcast.plan import Plan, save_plan, with_prediction
from rackcast.simulator import metrics
from rackcast.planner.rows import MEMORY_PARTS, Row
from rackcast.planner.search import Result, predicted_for
from rackcast.planner.space import LAYOUT_COLUMNS
from rackcast.units import GIB
from rackcast.vocab import PHASES


def fmt_rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s / 1e6:.3f} M"


def fmt_days(days: float) -> str:
    return "-" if math.isnan(days) else f"{days:.1f}" if days >= 1 else f"{days:.3g}"


def fmt_gib(n_bytes: float) -> str:
    gib = n_bytes / GIB
    return f"{gib:.0f}" if gib >= 10 else f"{gib:.2g}"


def deadline_cell(result: Result, row: Row) -> str:
    meets = result.meets_deadline(row)
    if meets is None:
        return "-"
    prob = result.deadline_prob.get(id(row))
    tail = f" ({100 * prob:.0f}%)" if prob is not None and not math.isnan(prob) else ""
    return ("yes" if meets else "no") + tail


KNOB_COLUMNS = (("batch", "global_batch"), ("mb", "micro_batch"), ("schedule", "schedule"),
                ("recompute", "recompute"), ("opt state", "opt_location"), ("a2a", "transport"), ("GPUs", "usable"))


def knob_text(lay: Layout, field: str, domain_label: str = "dom") -> str:
    """One knob of a layout as the table shows it."""
    if field == "schedule":
        return lay.schedule + (f" v{lay.parallel.virtual}" if lay.parallel.virtual > 1 else "") \
            if lay.parallel.pipeline > 1 else "-"
    if field == "usable":
        return f"{lay.usable}/{domain_label}"
    return str(getattr(lay, field))


def varying_knobs(layouts: list[Layout]) -> list[str]:
    """The knob fields (KNOB_COLUMNS) whose values differ between these layouts."""
    return [f for _, f in KNOB_COLUMNS if len({knob_text(lay, f) for lay in layouts}) > 1]


def distinct_label(lay: Layout, fields: list[str]) -> str:
    """The parallel degrees plus every knob in `fields` (the ones that differ between the rows shown), compactly, so
    no two different layouts read alike: e.g. 'd16 f44 e64 mb16 rc:full cap u64' (cap/drop: capacity or dropless
    all-to-all; u64: GPUs used per domain)."""
    parts = [lay.parallel_label]
    for f in fields:
        if f == "schedule":
            if lay.parallel.pipeline > 1:
                parts.append(lay.schedule)  # the virtual stages are in the parallel label (p2v2)
        elif f == "transport":
            parts.append(lay.transport[:4] if lay.transport == "dropless" else lay.transport[:3])
        elif f == "usable":
            parts.append(f"u{lay.usable}")
        else:
            prefix = {"global_batch": "gb", "micro_batch": "mb", "recompute": "rc:", "opt_location": "opt:"}[f]
            parts.append(f"{prefix}{getattr(lay, f)}")
    return " ".join(parts)


def _figure_cells(result: Result, row: Row) -> list[str]:
    return [fmt_rate(row.best_tokens_per_s), f"{100 * row.best_mfu:.1f}%",
            f"{fmt_gib(row.peak_memory)}/{fmt_gib(result.hbm_bytes)} GiB", fmt_days(result.p50_days(row)),
            fmt_days(row.best_days), deadline_cell(result, row), source_cell(row)]


def source_cell(row: Row) -> str:
    return "sim" if row.sim else "est"


def display_groups(result: Result, n: int) -> list[list[Row]]:
    """The best n ranked rows in groups: neighbours whose figures read the same and whose layouts differ only in
    knobs (same parallel degrees) are one group, shown once with their ranks (e.g. dropless and capacity transport
    when the all-to-all is hidden)."""
    groups: list[list[Row]] = []
    for row in result.ranked[:n]:
        last = groups[-1][-1] if groups else None
        if last is not None and last.layout.parallel_label == row.layout.parallel_label and \
                _figure_cells(result, last) == _figure_cells(result, row):
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def ranked_table(result: Result, n: int = 10) -> Table:
    """The best n rows. A knob gets a column only where it differs between the rows shown; the knobs they share are
    in the title. Rows that differ only in knobs and read the same are one line (display_groups)."""
    r = result.request
    groups = display_groups(result, n)
    shown = [row.layout for g in groups for row in g]
    varying = varying_knobs(shown)
    common = ", ".join("no pipeline" if f == "schedule" and shown[0].parallel.pipeline == 1 else
                       f"{title} {knob_text(shown[0], f, result.topo.domain_label)}" for title, f in KNOB_COLUMNS
                       if f not in varying) if shown else ""
    table = Table(title=f"{result.spec.name} on {r.racks} x {result.topo.name}, {r.tokens:.3g} tokens: best "
                        f"{min(n, len(result.ranked))} of {len(result.ranked)} ranked layouts "
                        f"(objective: {r.objective})" + (f"\nevery row: {common}" if common else ""),
                  title_justify="left")
    knobs = [(title, f) for title, f in KNOB_COLUMNS if f in varying]
    cols = ["#", "parallel", *(t for t, _ in knobs), "tokens/s", "MFU", "mem/GPU", "days P50", "days steady",
            "deadline", "src"]
    left = {"parallel", "schedule", "recompute", "opt state", "a2a"}
    for col in cols:
        table.add_column(col, justify="left" if col in left else "right", no_wrap=True)
    for group in groups:
        head = group[0]
        ranks = str(head.rank) if len(group) == 1 else f"{head.rank}-{group[-1].rank}"
        cells = []
        for _, f in knobs:
            values = list(dict.fromkeys(knob_text(x.layout, f, result.topo.domain_label) for x in group))
            cells.append(" | ".join(values))
        table.add_row(ranks, head.layout.parallel_label, *cells, *_figure_cells(result, head))
    return table


def table_notes(result: Result, n: int = 10) -> list[str]:
    """What the columns mean, and which rows were merged."""
    merged = [g for g in display_groups(result, n) if len(g) > 1]
    lines = ["days P50: with failures and restarts (planner.forecast), for the rows it was run on ('-' for the "
             "others); days steady: at the row's tokens/s without failures"]
    if merged:
        lines.append("rows with the same figures that differ only in the knobs shown with '|' are one line "
                     f"(ranks {', '.join(f'{g[0].rank}-{g[-1].rank}' for g in merged)})")
    return lines


def size_table(res) -> Table:
    """One row per shape of a model-size search (planner.size.SizeResult)."""
    table = Table(title=f"{res.family} on {res.racks} x {res.topology}, {res.tokens:.3g} tokens: best layout per shape",
                  title_justify="left")
    from rackcast.topologies import load_topology

    dom = load_topology(res.topology).domain_label
    cols = ["shape", "total", "active", "best layout", f"{dom}s/replica", f"min {dom}s/replica",
            f"1-{dom} EP+FSDP mem", "tokens/s", "MFU", "days", "deadline", "pareto", "src"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("shape", "best layout") else "right", no_wrap=True)
    for sh in res.shapes:
        spec = sh.spec
        one = f"{fmt_gib(sh.one_domain_memory)}/{fmt_gib(_hbm(sh, res))} GiB"
        head = [spec.name, f"{spec.params_total / 1e9:.1f}B", f"{spec.params_active / 1e9:.1f}B"]
        if sh.result is None:
            table.add_row(*head, "nothing fits", "-", "-", one, "-", "-", "-", "-", "-", "-")
            continue
        r, row = sh.result, sh.best
        lay = row.layout
        table.add_row(*head, lay.parallel_label, str(-(-lay.replica_gpus() // lay.usable)),
                      str(sh.min_domains_per_replica), one, fmt_rate(row.best_tokens_per_s),
                      f"{100 * row.best_mfu:.1f}%", fmt_days(r.days_for(row)), deadline_cell(r, row),
                      "yes" if sh.pareto else "", "sim" if row.sim else "est")
    return table


def _hbm(sh, res) -> float:
    if sh.result is not None:
        return sh.result.hbm_bytes
    from rackcast.topologies import load_topology

    return load_topology(res.topology).accelerator.hbm_bytes


def size_json(res) -> dict:
    shapes = []
    for sh in res.shapes:
        spec = sh.spec
        item = {"shape": spec.name, "layers": spec.layers, "d_model": spec.d_model,
                "experts": spec.moe.experts if spec.moe else 0, "top_k": spec.moe.top_k if spec.moe else 0,
                "params_total": spec.params_total, "params_active": spec.params_active,
                "one_domain_replica_memory_bytes": sh.one_domain_memory, "one_domain_replica": sh.one_domain_label,
                "fits": sh.result is not None, "reason": sh.reason, "pareto": sh.pareto}
        if sh.result is not None:
            r, row = sh.result, sh.best
            item.update({"best_layout": row.layout.label, "domains_per_replica": -(-row.layout.replica_gpus() //
                                                                                    row.layout.usable),
                         "min_domains_per_replica": sh.min_domains_per_replica,
                         "tokens_per_s": row.best_tokens_per_s, "mfu": row.best_mfu, "days": r.days_for(row),
                         "meets_deadline": r.meets_deadline(row), "simulated": bool(row.sim),
                         "candidates_ranked": r.counts["ranked"]})
        shapes.append(item)
    return {"family": res.family, "topology": res.topology, "racks": res.racks, "tokens": res.tokens,
            "candidates_enumerated": res.enumerated, "candidates_ranked": res.candidates,
            "simulated": res.simulated, "notes": res.notes, "shapes": shapes,
            "pareto_front": [sh.spec.name for sh in res.shapes if sh.pareto]}


def summary_lines(result: Result, n: int = 10) -> list[str]:
    c = result.counts
    lines = [f"candidates: {c['enumerated']} enumerated, {c['invalid']} refused by the divisibility rules, "
             f"{c['no_fit']} over memory, {c['ranked']} ranked by the closed-form estimate, "
             f"{c['simulated']} simulated",
             result.batch_note, result.sim_note, result.days_note, *table_notes(result, n)]
    if result.memory_note:
        lines.append(result.memory_note)
    if not math.isnan(result.available_days):
        lines.append(f"deadline: {result.request.deadline} is {result.available_days:.0f} days after "
                     f"{result.request.start}")
    if result.ranked:
        band = metrics.band_text(result.band_for(result.winner))
        if band:
            lines.append(f"winner's {band}")
    return lines



def row_data(result: Result, row: Row) -> dict:
    lay = row.layout
    out = {"rank": row.rank, "layout": lay.label, **lay.as_row(),
           "status": row.status, "reason": row.reason,
           "memory_per_gpu_bytes": row.memory.get("total", math.nan), "hbm_bytes": result.hbm_bytes,
           "host_bytes_per_host": row.host_per_host, "step_time_s": row.step_time_s,
           "tokens_per_s": row.tokens_per_s, "mfu": row.mfu, "days_steady": row.days,
           "drop_fraction": row.drop_fraction}
    if row.sim:
        out["simulated"] = {k: v for k, v in row.sim.items() if k != "phases_s"}
    if row.status == "ranked":
        out["source"] = "simulate" if row.sim else "estimate"
        out["days"] = result.days_for(row)
        out["days_p50"] = result.p50_days(row)
        out["meets_deadline"] = result.meets_deadline(row)
        out["phases_s"] = row.sim.get("phases_s", row.phases)
        out["band"] = result.band_for(row)
    return out


def result_json(result: Result, n: int = 10) -> dict:
    r = result.request
    return {
        "model": result.spec.name, "topology": result.topo.name, "racks": r.racks, "tokens": r.tokens,
        "objective": r.objective, "start": r.start, "deadline": r.deadline,
        "available_days": None if math.isnan(result.available_days) else result.available_days,
        "counts": result.counts, "notes": [result.batch_note, result.sim_note, result.days_note],
        "ranked": [row_data(result, row) for row in result.ranked[:n]],
    }


def write_parquet(result: Result, path: str | Path) -> int:
    """Every candidate (ranked, over memory, refused) with its figures, written atomically; returns the rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = sorted(result.rows, key=lambda x: (x.rank == 0, x.rank, x.status, x.layout.label, x.reason))
    cols: dict[str, list] = {"model": [], "status": [], "reason": [], "rank": [], "layout": []}
    for f in LAYOUT_COLUMNS:
        cols[f] = []
    for part in MEMORY_PARTS:
        cols[f"mem_{part}_bytes"] = []
    extra = ["host_bytes_per_host", "step_time_s", "tokens_per_s", "mfu", "days_steady", "drop_fraction"]
    extra += [f"phase_{p}_s" for p in PHASES]
    extra += ["sim_step_time_s", "sim_tokens_per_s", "sim_mfu", "sim_peak_memory_bytes", "sim_days", "days"]
    for e in extra:
        cols[e] = []
    cols["meets_deadline"] = []
    nan = math.nan
    for row in rows:
        lay = row.layout
        cols["model"].append(result.spec.name)
        cols["status"].append(row.status)
        cols["reason"].append(row.reason)
        cols["rank"].append(row.rank)
        cols["layout"].append(lay.label)
        for f, value in lay.as_row().items():
            cols[f].append(value)
        for part in MEMORY_PARTS:
            cols[f"mem_{part}_bytes"].append(float(row.memory.get(part, nan)))
        values = [row.host_per_host, row.step_time_s, row.tokens_per_s, row.mfu, row.days, row.drop_fraction]
        values += [row.phases.get(p, nan) for p in PHASES]
        values += [row.sim.get(k, nan) for k in ("step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes", "days")]
        values.append(result.days_for(row) if row.status == "ranked" else nan)
        for e, v in zip(extra, values):
            cols[e].append(float(v))
        cols["meets_deadline"].append(result.meets_deadline(row) if row.status == "ranked" else None)
    table = pa.table(cols)
    path = Path(path)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
    return table.num_rows


def best_plan(result: Result, command: str = "") -> Plan:
    row = result.winner
    plan = result.plan_for(row)
    return with_prediction(plan, predicted_for(result, row), command=command)


def write_best_plan(result: Result, path: str | Path, command: str = "") -> Plan:
    """The winner as a plan file with its predicted block and provenance (atomic write)."""
    plan = best_plan(result, command)
    save_plan(plan, str(path))
    return plan
