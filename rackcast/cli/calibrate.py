"""`rackcast calibrate`: measure this machine and write its topology, or fit a topology's efficiency factors to
measured runs.

    rackcast calibrate [--out runs/calibrated.yaml] [--quick]        # microbenchmarks (torch; gloo or NCCL)
    rackcast calibrate --from-run RUN_DIR [--from-run ...] [--topology T] --out fitted.yaml
    rackcast calibrate --from-measurement FILE [...] --out fitted.yaml
    rackcast calibrate --op-counts MODEL [MODEL ...]                # count a model's framework ops (cache)
    rackcast calibrate --op-counts-table [PATH]                      # regenerate simulator/op_counts.json (+ op_bytes.json)

A measurement file is YAML: `plan` (path, relative to the file), `step_time_s` or `tokens_per_s`, optionally
`phases_s` (trainer phase names: compute, exposed_expert_a2a, exposed_dp_comm, pipeline_bubble, optimizer, ...);
or `measurements:` holding a list of those. The fitted factors and what each needs are in validation.fit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from rackcast.cli.common import console, print_json, table
from rackcast.errors import RackcastError
from rackcast.strict import from_data, load_yaml

DEFAULT_OUT = "runs/calibrated.yaml"


@dataclass(frozen=True)
class MeasurementEntry:
    plan: str
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)
    label: str = ""


@dataclass(frozen=True)
class MeasurementFile:
    measurements: list[MeasurementEntry]


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="measure this machine (or fit measured runs) and write a topology YAML")
    p.add_argument("--out", help=f"topology YAML to write (default {DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true", help="fewer shapes and sizes (well under a minute)")
    p.add_argument("--world", type=int, default=0, help="processes to measure with (default: the GPUs on CUDA, "
                                                        "the base topology's usable GPUs on CPU)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per process on CPU (default as "
                                                          "`rackcast train`: 1)")
    p.add_argument("--base", help="preset for what is not measured (default local-cpu, or h200-hgx on CUDA)")
    p.add_argument("--name", help="topology name (default: the output file's stem)")
    p.add_argument("--save-measurements", metavar="JSON", help="also write the raw measurements")
    p.add_argument("--from-run", action="append", default=[], metavar="RUN_DIR",
                   help="fit factors to a run folder's record.json: the mean of its fastest steps (repeatable)")
    p.add_argument("--from-measurement", action="append", default=[], metavar="FILE",
                   help="fit factors to a measurement YAML (repeatable)")
    p.add_argument("--topology", help="topology to adjust when fitting (default: the first plan's)")
    p.add_argument("--factors", help="comma-separated factors to fit (default: all the measurements inform; "
                                     "'overall' when there are no phase times)")
    p.add_argument("--no-overhead", action="store_true", help="fit with the topology's host_op_s set to 0 (the "
                                                               "host per-op overhead is otherwise included when the "
                                                               "topology has a measured one)")
    p.add_argument("--op-counts", nargs="+", metavar="MODEL",
                   help="count the framework ops of these models (preset names or YAML paths) with both optimizers "
                        "into the op-count cache, where the host per-op overhead reads them")
    p.add_argument("--op-counts-table", nargs="?", const="", metavar="PATH",
                   help="count the tiny presets and write the table packaged with the simulator (default "
                        "simulator/op_counts.json); run after a torch or model change")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run)


def _run(args) -> int:
    if args.op_counts or args.op_counts_table is not None:
        return _count_ops(args)
    if args.from_run or args.from_measurement:
        return _fit(args)
    return _measure(args)


# --------------------------------------------------------------------------------------------------- op counts
def _count_ops(args) -> int:
    """The backend counts (backend.opcount); the simulator reads the files it writes (simulator.op_counts)."""
    import sys

    from rackcast.backend.opcount import count_into_cache, write_count_table
    from rackcast.simulator.op_bytes import TABLE_PATH as BYTES_PATH
    from rackcast.simulator.op_counts import TABLE_MODELS, TABLE_PATH

    written = []
    for model in args.op_counts or ():
        written += [str(p) for p in count_into_cache(model)]
    if args.op_counts_table is not None:
        path = Path(args.op_counts_table or TABLE_PATH)
        bytes_path = path.with_name(BYTES_PATH.name)  # the eager bytes' table beside it
        n = write_count_table(list(TABLE_MODELS), path=path, bytes_path=bytes_path,
                              progress=lambda label: print(f"counting {label}", file=sys.stderr))
        written.append(f"{path} and {bytes_path} ({n} entries)")
    if args.json:
        print_json({"written": written})
    else:
        for w in written:
            console().print(f"wrote {w}")
    return 0


# --------------------------------------------------------------------------------------------- microbenchmarks
def _measure(args) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from rackcast.backend.calibrate import default_device, measure
    from rackcast.validation.calibration import build_topology, header_for, write_topology
    from rackcast.topologies import load_topology
    from rackcast.atomic import write_text_atomic

    device = default_device()
    base = load_topology(args.base or ("h200-hgx" if device.type == "cuda" else "local-cpu"))
    if args.world:
        world = args.world
    elif device.type == "cuda":
        import torch

        world = torch.cuda.device_count()
    else:
        world = base.scale_up.usable_gpus
    if world <= 0:
        raise RackcastError(f"--world must be positive, got {world}")
    out = Path(args.out or DEFAULT_OUT)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeElapsedColumn(), console=console().__class__(stderr=True), transient=False)
    with progress:
        task = progress.add_task(f"calibrating ({world} processes)", total=None)

        def on_tick(label, done, total):
            progress.update(task, completed=done, total=total, description=f"calibrate: {label:<34}")

        meas = measure(world, args.quick, on_tick, threads=args.threads)
    if args.save_measurements:
        write_text_atomic(args.save_measurements, json.dumps(meas, indent=1) + "\n")
    topo, notes = build_topology(meas, base, args.name or out.stem)
    command = "rackcast calibrate" + (" --quick" if args.quick else "")
    write_topology(out, topo, header_for(meas, notes, command))
    e = topo.efficiency
    if args.json:
        from rackcast.strict import to_data

        print_json({"out": str(out), "wall_s": meas["wall_s"], "topology": to_data(topo)})
        return 0
    c = console()
    rows = [[k, f"{v / 1e9:.1f} GFLOP/s"] for k, v in topo.accelerator.peak_flops.items()]
    rows += [["memory bandwidth", f"{topo.accelerator.hbm_bandwidth_Bps / 1e9:.1f} GB/s"],
             ["link (one-way send/recv)", f"{topo.scale_up.bandwidth_Bps / 1e9:.2f} GB/s, "
                                          f"latency {topo.scale_up.latency_s * 1e6:.0f} us"],
             ["gemm efficiency", ", ".join(f"{p.size:.2g}: {p.value:.2f}" for p in e.gemm)],
             ["grouped gemm efficiency", ", ".join(f"{p.size:.2g}: {p.value:.2f}" for p in e.grouped_gemm)],
             *([[f"{name} surface", f"{len(surf)} shapes m x n x k, efficiency {min(p.efficiency for p in surf):.3f}"
                 f" to {max(p.efficiency for p in surf):.3f}"]
                for name, surf in (("gemm", e.gemm_surface), ("grouped gemm", e.grouped_gemm_surface)) if surf]),
             ["attention / memory-bound", f"{e.attention:.3f} / {e.memory_bound:.3f}"],
             *([[f"attention {kind} surface", f"{len(surf)} calls, efficiency {min(p.efficiency for p in surf):.3f} to "
                 f"{max(p.efficiency for p in surf):.3f}"] for kind in ("causal", "banded")
                if (surf := [p for p in e.attention_surface if p.kind == kind])]),
             ["host time per framework op", f"forward {e.host_op_s.forward * 1e6:.2f} us, backward "
                                            f"{e.host_op_s.backward * 1e6:.2f} us, optimizer "
                                            f"{e.host_op_s.optimizer * 1e6:.2f} us"]]
    rows += [[f"{k} busbw/link", ", ".join(f"{p.size:.2g}B: {p.value:.2f}" for p in v.scale_up)]
             for k, v in e.collectives.items()]
    c.print(table(f"Calibrated {topo.name} ({meas['wall_s']:.0f} s; efficiencies are fractions of bf16 peak)",
                  ["figure", "value"], rows))
    c.print(f"wrote {out}; use it with `topology: {{name: {out}}}` in a plan, or --topology {out}")
    return 0


# ----------------------------------------------------------------------------------------------------- fitting
def load_measurements(args) -> list:
    return read_measurements(args.from_run, args.from_measurement)


def read_measurements(runs: list[str], files: list[str]) -> list:
    """validation.fit.Measurement for each run folder (record.json: its fastest-steps figure,
    backend.record.measured_figure) and each measurement YAML."""
    from rackcast.backend.record import measured_figure
    from rackcast.validation.compare import load_record
    from rackcast.validation.fit import Measurement
    from rackcast.plan import load_plan

    out = []
    for run in runs:
        rec_path = Path(run) / "record.json"
        rec = load_record(run)
        plan_path = Path(rec.get("plan_path", ""))
        if not plan_path.exists() and (Path(run) / "plan.yaml").exists():
            plan_path = Path(run) / "plan.yaml"
        if not plan_path.exists():
            raise RackcastError(f"the run's plan {rec.get('plan_path')!r} is not found (copy it to plan.yaml in the "
                                "run folder)", where=str(rec_path))
        figure = measured_figure(rec)
        step, phases = figure["step_time_s"], figure["phases_s"]
        out.append(Measurement(load_plan(str(plan_path)), step, {k: float(v) for k, v in phases.items() if v == v},
                               label=str(run)))
    for path in files:
        data = load_yaml(path)
        if isinstance(data, dict) and "measurements" not in data:
            data = {"measurements": [data]}
        mf = from_data(MeasurementFile, data, where=path)
        for i, e in enumerate(mf.measurements):
            plan = load_plan(str(Path(path).parent / e.plan) if not Path(e.plan).exists() else e.plan)
            step = e.step_time_s
            if step <= 0 and e.tokens_per_s > 0:
                step = plan.tokens_per_step(plan.model_spec()) / e.tokens_per_s
            if step <= 0:
                raise RackcastError(f"measurements[{i}]: needs a positive step_time_s or tokens_per_s", where=path)
            out.append(Measurement(plan, step, dict(e.phases_s), label=e.label or f"{path}[{i}]"))
    return out


def fit_topology(ms: list, topology: str | None, out: Path, names: list[str] | None = None,
                 no_overhead: bool = False):
    """Fit the efficiency factors of `topology` (default: the first measured plan's) to the measurements and write
    the fitted topology to `out`; returns (validation.fit.FitResult, the fitted Topology)."""
    from dataclasses import replace

    from rackcast.topologies import load_topology
    from rackcast.validation.calibration import write_topology
    from rackcast.validation.fit import fit

    first = ms[0].plan.topology
    topo = load_topology(topology or first.name, first.domains, None)
    if no_overhead:
        topo = topo.with_efficiency(topo.efficiency.without_host_ops())
    res = fit(ms, topo, names)
    header = [f"rackcast calibrate: {topo.name} with efficiency factors fitted to {len(ms)} measurement(s):",
              *[f"  {m.label}: plan {m.plan.name}, step {m.step_time_s:.4g} s, phases "
                f"{', '.join(f'{k} {v:.3g}' for k, v in m.phases_s.items() if v) or 'none'}" for m in ms],
              "fitted factors (x efficiency; comm_compute_slowdown added), standard error of log factor, identified:",
              *[f"  {k}: {v:.4g} (se {res.std_error[k]:.2g}, "
                f"{'identified' if res.identified[k] else 'NOT identified: kept near 1 by the prior'})"
                for k, v in res.fitted.items()],
              f"rms residual {res.rms_before:.3g} before, {res.rms_after:.3g} after (validation.fit)"]
    fitted = replace(res.topology, name=out.stem,
                     efficiency=replace(res.topology.efficiency,
                                        source=f"{topo.efficiency.source} -- scaled by factors fitted to "
                                               f"{len(ms)} measured run(s) (rackcast calibrate)"))
    write_topology(out, fitted, header)
    return res, fitted


def _fit(args) -> int:
    from rackcast.validation.fit import FACTORS

    ms = load_measurements(args)
    names = None
    if args.factors:
        names = [n.strip() for n in args.factors.split(",") if n.strip()]
        bad = [n for n in names if n not in FACTORS + ("overall",)]
        if bad:
            raise RackcastError(f"--factors: unknown factor {bad[0]!r} (known: overall, {', '.join(FACTORS)})")
    out = Path(args.out or DEFAULT_OUT)
    res, _ = fit_topology(ms, args.topology, out, names, args.no_overhead)
    if args.json:
        print_json({"out": str(out), **res.as_dict()})
        return 0
    c = console()
    rows = [[k, f"{v:.4g}", f"{res.std_error[k]:.2g}", "yes" if res.identified[k] else "no"]
            for k, v in res.fitted.items()]
    c.print(table("Fitted efficiency factors", ["factor", "value", "se(log)", "identified"], rows))
    rows = [[m.label, f"{m.step_time_s:.4f}", f"{100 * b:+.1f}%", f"{100 * a:+.1f}%"]
            for m, b, a in zip(ms, res.step_error_before, res.step_error_after)]
    c.print(table("Step time: predicted vs measured (closed-form estimate)", ["run", "measured s", "before", "after"],
                  rows))
    c.print(f"wrote {out}")
    return 0
