"""Simulation metrics as deterministic JSON and as a one-row Parquet table (pyarrow).

JSON: the SimResult metrics (no timeline) with sorted keys, floats rounded to 12 significant digits and NaN
written as null, so the same plan and seed give byte-identical files. Parquet: one row, scalar metrics as
columns, each phase as `phase_<name>_s`, peak memory per stage as a list column.

    from rackcast.simulator.results import result_json, write_json, write_parquet
"""

from __future__ import annotations

import json
import math

from rackcast.atomic import atomic_path, write_text_atomic

SIGNIFICANT = 12


def _clean(x):
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else float(f"{x:.{SIGNIFICANT}g}")
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "item"):  # numpy scalars
        return _clean(x.item())
    return x


def result_data(result, **extra) -> dict:
    return _clean({**extra, **result.as_dict()})


def result_json(result, **extra) -> str:
    return json.dumps(result_data(result, **extra), sort_keys=True, indent=2) + "\n"


def write_json(result, path: str, **extra) -> None:
    write_text_atomic(path, result_json(result, **extra))


def result_row(result) -> dict:
    data = result_data(result)
    row = {k: v for k, v in data.items() if not isinstance(v, (dict, list))}
    for name, seconds in sorted(data["phases_s"].items()):
        row[f"phase_{name}_s"] = seconds
    row["peak_memory_per_stage_bytes"] = data["peak_memory_per_stage_bytes"]
    return row


def write_parquet(result, path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = result_row(result)
    table = pa.Table.from_pylist([row])
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)
