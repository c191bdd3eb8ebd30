"""Chrome / Perfetto trace of a simulated step (simulator.step.SimResult.timeline) as trace-event JSON.

One process per simulated rank class (pipeline stage), one thread per stream: "compute", then one per link class
and communication stream ("nvlink ep", "nic dp", "host link", ...); complete events ("ph": "X") with microsecond
timestamps. Counters ("ph": "C"): each stage's allocated memory, and in a separate "links" process the utilisation
(fraction of capacity in use) of every link that carried traffic. Output is deterministic: sorted keys, times
rounded to nanoseconds. Open the file in https://ui.perfetto.dev or chrome://tracing.

"""

from __future__ import annotations

import json

from rackcast.atomic import write_text_atomic
from rackcast.units import GIB, US_PER_S


def _us(t: float) -> float:
    return round(t * US_PER_S, 3)  # trace-event times are microseconds


def trace_events(result) -> list[dict]:
    tl = result.timeline
    events: list[dict] = []
    threads: dict[tuple[int, str], int] = {}
    for pid in sorted(tl.process_names):
        events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                       "args": {"name": tl.process_names[pid]}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
    names = sorted({(pid, th) for pid, th, *_ in tl.slices}, key=lambda k: (k[0], k[1] != "compute", k[1]))
    for pid, th in names:
        tid = threads[(pid, th)] = sum(1 for k in threads if k[0] == pid)
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": th}})
    for pid, th, name, start, end in tl.slices:
        cat = "compute" if th == "compute" else "communication"
        events.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": threads[(pid, th)],
                       "ts": _us(start), "dur": round(_us(end) - _us(start), 3)})
    for pid in sorted(tl.memory):
        last = None
        for t, nbytes in tl.memory[pid]:
            point = (_us(t), round(nbytes / GIB, 6))
            if point != last:
                events.append({"ph": "C", "name": "memory (GiB)", "pid": pid, "tid": 0, "ts": point[0],
                               "args": {"allocated": point[1]}})
            last = point
    times, links, rates = tl.utilisation
    if len(times):
        link_pid = max(tl.process_names, default=0) + 1
        events.append({"ph": "M", "name": "process_name", "pid": link_pid, "tid": 0,
                       "args": {"name": "links (fraction of capacity in use)"}})
        for t, li, r in zip(times.tolist(), links.tolist(), rates.tolist()):
            events.append({"ph": "C", "name": tl.links[li], "pid": link_pid, "tid": 0, "ts": _us(t),
                           "args": {"utilisation": round(r / tl.link_capacity_Bps[li], 6)}})
    return events


def trace_json(result) -> str:
    doc = {"traceEvents": trace_events(result), "displayTimeUnit": "ms",
           "metadata": {"plan": result.plan, "step_time_s": result.step_time_s, "seed": result.seed}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n"


def write_trace(result, path: str) -> None:
    write_text_atomic(path, trace_json(result))
