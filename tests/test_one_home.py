"""One home per concept: unit constants live in rackcast/units.py, atomic writes in rackcast/atomic.py, schedule and
phase vocabularies in rackcast/vocab.py. Each test scans the package source (text, nothing imported) for a second
definition; and atomic_path leaves the old file and no temporary when its writer fails."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rackcast.atomic import atomic_path, write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("rackcast", "topologies", "simulator", "planner", "backend", "validation", "benchmarks")

# (what, pattern, the one file allowed to hold it)
HOMES = [
    # (a count's bound, Range(1, 2**20), is not a unit of bytes)
    ("binary unit constant", r"^(?!.*Range\().*(\b2\s*\*\*\s*(10|20|30|40)\b|\b1024\s*\*\*\s*[23]\b)",
     "rackcast/units.py"),
    ("seconds per day or hour", r"\b86400\b|\b3600(\.0)?\b(?!\.)", "rackcast/units.py"),
    ("an atomic file rename", r"os\.replace\(|\.replace\(path\)|mkstemp\(", "rackcast/atomic.py"),
    ("the phase list", r'"exposed_expert_a2a",\s*"exposed_tensor_comm"', "rackcast/vocab.py"),
    ("the schedule list", r'"interleaved_1f1b",\s*"zb_h1"', "rackcast/vocab.py"),
    ("a torch schedule class table", r'"ScheduleGPipe"', "rackcast/vocab.py"),
    ("the Newton-Schulz step count", r"NEWTON_SCHULZ_STEPS\s*=|ns_steps: int = \d", "rackcast/vocab.py"),
    ("the balance-bins default", r"BINS\s*=\s*\d|balance_bins: int = \d|bins: int = \d", "rackcast/vocab.py"),
]


def code_lines(path: Path):
    """(line number, text) of the lines outside comments, up to a `__main__` block (demo blocks are going away)."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("if __name__ == "):
            return
        code = line.split("#", 1)[0]
        if code.strip():
            yield n, code


def sources() -> list[Path]:
    out = [ROOT / "tui.py"]
    for folder in FOLDERS:
        out += sorted((ROOT / folder).rglob("*.py"))
    return out


@pytest.mark.parametrize("what,pattern,home", HOMES, ids=[h[0] for h in HOMES])
def test_each_concept_is_defined_in_its_one_home(what, pattern, home):
    rx = re.compile(pattern)
    # backend/checkpoint.py publishes a whole checkpoint *folder* (torch.distributed.checkpoint writes many files)
    # by renaming it: a folder, not a file write, so not rackcast.atomic's concern.
    skip = {home} | ({"backend/checkpoint.py"} if what == "an atomic file rename" else set())
    found = [f"{p.relative_to(ROOT)}:{n}" for p in sources() if str(p.relative_to(ROOT)) not in skip
             for n, code in code_lines(p) if rx.search(code) and "python -m" not in code]
    assert not found, f"{what} outside {home}: {', '.join(found)}"


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    write_text_atomic(path, "old\n")
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("interrupted")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    write_text_atomic(path, "new\n")
    assert path.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
