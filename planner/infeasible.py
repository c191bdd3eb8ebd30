"""Why a layout search found nothing that fits: the tightest constraint, in one line with numbers, for the error
`rackcast plan` prints when every candidate is over memory (or refused by the divisibility rules).

    from rackcast.planner.infeasible import tightest_constraint
    raise RackcastError(tightest_constraint(result))      # result: planner.search.Result with no ranked rows
"""

from __future__ import annotations

import math

from rackcast.units import GIB


def tightest_constraint(result) -> str:
    """One line: why nothing fits, with numbers. `result` is a planner.search.Result (not imported: search
    imports this module, and a type-only import back would be an import cycle)."""
    rows = result.rows
    mem_rows = [x for x in rows if x.memory]
    if not mem_rows:
        reasons = sorted({x.reason.partition(":")[0] for x in rows})
        example = rows[0].reason if rows else "no layout divides the GPUs"
        return (f"no layout of {result.spec.name} divides {result.request.racks} x {result.topo.name} evenly "
                f"(rules hit: {', '.join(reasons)}; e.g. {example})")
    best = min(mem_rows, key=lambda x: (x.memory["total"], x.layout.label))
    m = best.memory
    hbm = result.hbm_bytes
    lay = best.layout
    gpus_now = lay.replica_gpus()
    # Model state shrinks with the GPUs a replica is sharded over; activations and buffers do not.
    state = m["weights"] + m["gradients"] + m["master"] + m["optimizer"]
    rest = m["total"] - state
    per_domain = lay.usable
    if m["total"] <= hbm:  # HBM fits, host memory does not
        return (f"nothing fits: host memory {best.host_per_host / GIB:.1f} GiB per host exceeds "
                f"{result.host_bytes / GIB:.1f} GiB for the leanest layout ({lay.label})")
    if rest >= hbm:
        need = "no sharding helps: activations and buffers alone exceed HBM"
    else:
        gpus_needed = math.ceil(state * gpus_now / (hbm - rest))
        need = (f"a replica would need about {math.ceil(gpus_needed / per_domain)} {result.topo.domain_label}s "
                f"({gpus_needed} GPUs) to shard model state, have {result.request.racks}")
    return (f"nothing fits: the smallest memory per GPU any layout reaches is {m['total'] / GIB:.1f} GiB "
            f"({lay.label}) against {hbm / GIB:.1f} GiB HBM; {need}")
