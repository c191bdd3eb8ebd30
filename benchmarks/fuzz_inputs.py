"""Mutation fuzzer over rackcast's input files: plans, model presets and topology presets.

Each mutant starts from one example plan (examples/plans/), model preset (rackcast/model_presets/) or topology preset
(topologies/presets/) and applies 1-3 seeded mutations: a value replaced by an awkward one (0, -1, 10**30, 1.0e300,
.nan, .inf, a quoted '1e7', 5,000 characters, `../../topologies/presets/h100-hgx`, 2026-13-45, a list, a mapping),
a number scaled by 10^k or negated, a key deleted or an unknown one added; or a change to the bytes (a non-UTF-8
byte, an alias bomb under a field, deep nesting, the file cut short). A model or topology mutant is run through a
plan that names it by path. Every mutant goes through `rackcast estimate PLAN --json`, in this process
(rackcast.cli.main with --debug, so an unexpected exception propagates), and those estimate accepts go through
`rackcast simulate PLAN --json`, each under a limit of CPU seconds (ITIMER_PROF: on a shared machine wall time
says more about the neighbours than about the work). Outcomes:

- refused: exit code 2 with one line on stderr (bad input, as designed);
- accepted: exit code 0 with JSON that parses strictly (no NaN or Infinity);
- uncaught: any other exception or exit code, a refusal that is not one line, or JSON with NaN/Infinity;
- hung: over the CPU time limit.

    .venv/bin/python benchmarks/fuzz_inputs.py                    # 10,000 mutants, seed 0
    .venv/bin/python benchmarks/fuzz_inputs.py -n 500 --seed 3 --show 5 --jobs 2

Prints the counts for estimate and for simulate, the distinct failures (exception type and message, with one
mutant each) and the seconds taken. tests/test_fuzz_inputs.py runs a few hundred mutants of the same generator.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
PLAN_DIR = ROOT / "examples" / "plans"
MODEL_DIR = ROOT / "rackcast" / "model_presets"
TOPOLOGY_DIR = ROOT / "topologies" / "presets"
ESTIMATE_LIMIT_S = 30.0  # CPU seconds per mutant; the estimate of any example plan takes milliseconds
SIMULATE_LIMIT_S = 240.0  # CPU seconds per mutant; simulate's work bound keeps a step to about a minute or two
RAW = "__raw__"  # a string value starting with this is written into the YAML text as is (unquoted)

AWKWARD = [0, 1, -1, 2, 3, 7, 64, 1000003, 2**31, 2**63, 10**30, -5, 0.5, 1e-300, 3.7, True, False, None, "", "x",
           "1e7", "a" * 5000, "../../topologies/presets/h100-hgx", "2026-13-45", "2026-01-01", "2025-06-30", [], {},
           [1, 2], {"a": 1}, "é", "local-cpu", "tiny-moe", "gb200-nvl72", "capacity", "zipf", "histogram",
           RAW + "1.0e300", RAW + ".nan", RAW + ".inf", RAW + "-.inf", RAW + "1e7", RAW + "1e30", RAW + "0x10",
           RAW + "1_000", RAW + "~", RAW + "2026-13-45", RAW + "1e-7", RAW + "'1e7'"]


@dataclass
class Tally:
    refused: int = 0
    accepted: int = 0
    uncaught: int = 0
    hung: int = 0
    failures: dict = field(default_factory=dict)  # signature -> (count, mutant description)

    def fail(self, kind: str, signature: str, description: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        count, example = self.failures.get(signature, (0, description))
        self.failures[signature] = (count + 1, example)


class Hung(Exception):
    pass


def _alarm(signum, frame):
    raise Hung()


# ------------------------------------------------------------------------------------------------ mutations
def _paths(node, prefix=()):
    """Every path to a value in a YAML tree (dict keys and list indices)."""
    out = []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, value in items:
        out.append(prefix + (key,))
        out.extend(_paths(value, prefix + (key,)))
    return out


def _parent(doc, path):
    node = doc
    for key in path[:-1]:
        node = node[key]
    return node


def mutate_tree(doc, rng: random.Random) -> tuple[object, list[str]]:
    """1-3 structural mutations of a parsed YAML document; returns it and what was done."""
    notes = []
    for _ in range(rng.randint(1, 3)):
        paths = _paths(doc)
        if not paths:
            break
        path = rng.choice(paths)
        parent, key = _parent(doc, path), path[-1]
        value = parent[key]
        op = rng.random()
        if op < 0.5:
            new = copy.deepcopy(rng.choice(AWKWARD))
            parent[key] = new
            notes.append(f"{'.'.join(map(str, path))}={str(new)[:40]!r}")
        elif op < 0.75 and isinstance(value, (int, float)) and not isinstance(value, bool):
            k = rng.choice([1, 2, 3, 6, 9, 12, 20, 30, 100, 300])
            new = rng.choice([value * 10**k, -value, value + 1, value - 1, value / 3, value * 10.0**k])
            parent[key] = new
            notes.append(f"{'.'.join(map(str, path))}*={str(new)[:40]}")
        elif op < 0.87 and isinstance(parent, dict):
            del parent[key]
            notes.append(f"del {'.'.join(map(str, path))}")
        elif isinstance(parent, dict):
            parent[rng.choice(["bogus", "Name", "domains", "seed", "tokens", "lr"])] = rng.choice(AWKWARD[:20])
            notes.append(f"add key under {'.'.join(map(str, path[:-1])) or 'top'}")
        else:
            parent[key] = copy.deepcopy(rng.choice(AWKWARD))
            notes.append(f"{'.'.join(map(str, path))} replaced")
    return doc, notes


def to_text(doc) -> str:
    """YAML text of a mutated tree, with the RAW markers written unquoted."""
    text = yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=10**6)
    for raw in (a for a in AWKWARD if isinstance(a, str) and a.startswith(RAW)):
        text = text.replace(raw, raw[len(RAW):])
    return text


def mutate_bytes(text: str, rng: random.Random) -> tuple[bytes, str]:
    """A change to the file's bytes or text that a tree cannot express."""
    data = text.encode()
    op = rng.randrange(5)
    if op == 0:
        at = rng.randrange(len(data) + 1)
        return data[:at] + bytes([rng.choice([0xff, 0xfe, 0xc3, 0x80])]) + data[at:], "non-UTF-8 byte"
    if op == 1:
        bomb = "".join(f"b{i}: &b{i} [{', '.join([f'*b{i - 1}' if i else '1'] * 9)}]\n" for i in range(9))
        lines = text.splitlines()
        keys = [i for i, line in enumerate(lines) if ":" in line and not line.startswith(" ")]
        if keys:
            i = rng.choice(keys)
            lines[i] = lines[i].split(":")[0] + ": *b8"
        return (bomb.replace("b0: &b0", "b0: &b0") + "\n".join(lines)).encode(), "alias bomb"
    if op == 2:
        depth = rng.choice([200, 5000])
        return (text + f"\nbogus: {'[' * depth}{']' * depth}\n").encode(), f"nesting {depth} deep"
    if op == 3:
        return data[:rng.randrange(len(data) + 1)], "cut short"
    at = rng.randrange(len(data)) if data else 0
    return data[:at] + bytes([rng.randrange(256)]) + data[at + 1:], "byte changed"


# ------------------------------------------------------------------------------------------------ mutants
def _load(path: Path):
    return yaml.safe_load(path.read_text())


def host_plan(kind: str, name: str, plans: dict[str, dict]) -> dict:
    """An example plan that uses model or topology `name`, else tiny-1proc re-pointed at it (one GPU)."""
    for plan in plans.values():
        used = plan["model"] if kind == "model" else plan["topology"]["name"]
        if used == name:
            return copy.deepcopy(plan)
    plan = copy.deepcopy(plans["tiny-1proc"])
    if kind == "topology":
        plan["topology"] = {"name": name, "domains": 1, "usable_gpus": 1}
    else:
        plan["model"] = name
    return plan


def make_mutant(i: int, seed: int, folder: Path, sources: dict) -> tuple[Path, str]:
    """Write mutant `i` (a plan, and the model or topology file it names) under `folder`; returns the plan path and a
    description."""
    rng = random.Random(seed * 1_000_003 + i)
    kind = rng.choices(["plan", "model", "topology"], weights=[2, 1, 1])[0]
    name = rng.choice(sorted(sources[kind]))
    doc = copy.deepcopy(sources[kind][name])
    doc, notes = mutate_tree(doc, rng) if rng.random() < 0.9 else (doc, [])
    text = to_text(doc)
    data = text.encode()
    if not notes or rng.random() < 0.1:
        data, note = mutate_bytes(text, rng)
        notes.append(note)
    folder.mkdir(parents=True, exist_ok=True)
    plan_path = folder / "plan.yaml"
    if kind == "plan":
        plan_path.write_bytes(data)
    else:
        target = folder / f"{kind}.yaml"
        target.write_bytes(data)
        plan = host_plan(kind, name, sources["plan"])
        if kind == "model":
            plan["model"] = str(target)
        else:
            plan["topology"]["name"] = str(target)
        plan_path.write_text(yaml.safe_dump(plan, sort_keys=False))
    return plan_path, f"#{i} {kind} {name}: {'; '.join(notes)}"


def load_sources() -> dict:
    return {"plan": {p.stem: _load(p) for p in sorted(PLAN_DIR.glob("*.yaml"))},
            "model": {p.stem: _load(p) for p in sorted(MODEL_DIR.glob("*.yaml"))},
            "topology": {p.stem: _load(p) for p in sorted(TOPOLOGY_DIR.glob("*.yaml"))}}


# ------------------------------------------------------------------------------------------------ running
def _strict_json(text: str) -> None:
    def refuse(constant):
        raise ValueError(f"JSON holds {constant}")

    json.loads(text, parse_constant=refuse)


def run_command(command: str, plan_path: Path, limit_s: float) -> tuple[str, str]:
    """(outcome, signature): outcome is refused, accepted, uncaught or hung."""
    from rackcast.cli import main

    out, err = io.StringIO(), io.StringIO()
    signal.setitimer(signal.ITIMER_PROF, limit_s)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["--debug", command, str(plan_path), "--json"])
    except Hung:
        return "hung", f"{command}: over {limit_s:.0f} CPU seconds"
    except BaseException as exc:  # noqa: BLE001 - counting every escape is the point
        signal.setitimer(signal.ITIMER_PROF, 0)
        where = exc.__traceback__
        while where is not None and where.tb_next is not None:
            where = where.tb_next
        origin = f"{Path(where.tb_frame.f_code.co_filename).name}:{where.tb_lineno}" if where else "?"
        return "uncaught", f"{command}: {type(exc).__name__} at {origin}: {str(exc)[:120]}"
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
    if rc == 2:
        lines = err.getvalue().strip().splitlines()
        if len(lines) != 1 or len(lines[0]) > 2000:
            return "uncaught", f"{command}: refusal of {len(lines)} lines / {len(err.getvalue())} chars"
        return "refused", ""
    if rc != 0:
        return "uncaught", f"{command}: exit code {rc}: {err.getvalue()[:120]}"
    try:
        _strict_json(out.getvalue())
    except ValueError as exc:
        return "uncaught", f"{command}: output is not strict JSON: {str(exc)[:80]}"
    return "accepted", ""


def fuzz(n: int, seed: int = 0, estimate_limit_s: float = ESTIMATE_LIMIT_S,
         simulate_limit_s: float = SIMULATE_LIMIT_S, progress: bool = False, only: tuple[str, ...] = (),
         indices: range | list[int] | None = None) -> tuple[Tally, Tally]:
    """Run mutants 0..n-1 (or `indices`) through estimate and the accepted ones through simulate; (estimate tally,
    simulate tally). `only`: use only the sources whose names start with one of these prefixes."""
    import functools
    import os

    import rackcast.cli
    from rackcast.simulator.op_counts import CACHE_ENV

    # one parser for every call: main() builds it anew each time, which is most of a refused mutant's cost
    rackcast.cli.build_parser = functools.lru_cache(maxsize=1)(rackcast.cli.build_parser)
    sources = load_sources()
    if only:
        sources = {kind: {name: doc for name, doc in docs.items() if name.startswith(only)}
                   for kind, docs in sources.items()}
    est, sim = Tally(), Tally()
    previous = signal.signal(signal.SIGPROF, _alarm)
    with tempfile.TemporaryDirectory(prefix="rackcast-fuzz-") as tmp:
        os.environ.setdefault(CACHE_ENV, str(Path(tmp) / "cache"))
        try:
            for done, i in enumerate(range(n) if indices is None else indices):
                plan_path, description = make_mutant(i, seed, Path(tmp) / f"m{i}", sources)
                outcome, signature = run_command("estimate", plan_path, estimate_limit_s)
                if outcome in ("uncaught", "hung"):
                    est.fail(outcome, signature, description)
                else:
                    setattr(est, outcome, getattr(est, outcome) + 1)
                if outcome == "accepted":
                    outcome, signature = run_command("simulate", plan_path, simulate_limit_s)
                    if outcome in ("uncaught", "hung"):
                        sim.fail(outcome, signature, description)
                    else:
                        setattr(sim, outcome, getattr(sim, outcome) + 1)
                if progress and outcome in ("uncaught", "hung"):
                    print(f"  {outcome}: {signature}\n    e.g. {description[:200]}", file=sys.stderr, flush=True)
                if progress and (done + 1) % 100 == 0:
                    print(f"  [{os.getpid()}] {done + 1} mutants: estimate refused {est.refused} accepted "
                          f"{est.accepted} uncaught {est.uncaught} hung {est.hung}; simulate refused {sim.refused} "
                          f"accepted {sim.accepted} uncaught {sim.uncaught} hung {sim.hung}", file=sys.stderr,
                          flush=True)
        finally:
            signal.signal(signal.SIGPROF, previous)
    return est, sim


def _fuzz_part(job: tuple[int, int, int, int]) -> tuple[Tally, Tally]:
    n, seed, jobs, part = job
    return fuzz(n, seed, progress=True, indices=range(part, n, jobs))


def merge(tallies: list[Tally]) -> Tally:
    out = Tally()
    for t in tallies:
        out.refused += t.refused
        out.accepted += t.accepted
        out.uncaught += t.uncaught
        out.hung += t.hung
        for signature, (count, example) in t.failures.items():
            total, first = out.failures.get(signature, (0, example))
            out.failures[signature] = (total + count, first)
    return out


def _report(label: str, tally: Tally, total: int, show: int) -> None:
    print(f"{label:9s} {total:6d} mutants: refused {tally.refused}, accepted {tally.accepted}, "
          f"uncaught {tally.uncaught}, hung {tally.hung}")
    for signature, (count, example) in sorted(tally.failures.items(), key=lambda kv: -kv[1][0])[:show]:
        print(f"    {count:4d} x {signature}\n           e.g. {example[:200]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=10_000, help="mutants (default 10,000)")
    parser.add_argument("--seed", type=int, default=0, help="mutation seed (default 0)")
    parser.add_argument("--show", type=int, default=20, help="distinct failures to print per command (default 20)")
    parser.add_argument("--jobs", type=int, default=1, help="processes, each taking every jobs-th mutant (default 1)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    if args.jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            parts = pool.map(_fuzz_part, [(args.n, args.seed, args.jobs, j) for j in range(args.jobs)])
        est, sim = merge([p[0] for p in parts]), merge([p[1] for p in parts])
    else:
        est, sim = fuzz(args.n, args.seed, progress=True)
    _report("estimate", est, args.n, args.show)
    _report("simulate", sim, est.accepted, args.show)
    print(f"{time.perf_counter() - t0:.0f} s for {args.n} mutants (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
