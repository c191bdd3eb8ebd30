"""Errors raised by library code name no command-line flag (the library also serves the TUI and Python callers);
the CLI adds the flag of the input at fault (RackcastError.option is its argparse dest)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = [ROOT / d for d in ("simulator", "planner", "backend", "topologies", "validation")] + \
    sorted((ROOT / "rackcast").glob("*.py"))
FLAG = re.compile(r"(^|[\s(`'\"])--[a-z]")


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def _error_messages(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string passed to RackcastError(...), a `fail` helper raising it, or a subclass's
    super().__init__ in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if name in ("RackcastError", "OpCountsMissing", "fail") or name == "__init__":
                out += [(node.lineno, s) for a in node.args for s in _strings(a)]
    return out


def test_library_errors_name_no_cli_flag():
    files = [p for entry in LIBRARY for p in ([entry] if entry.is_file() else sorted(entry.rglob("*.py")))]
    found = [f"{p.relative_to(ROOT)}:{line}: {text!r}" for p in files for line, text in _error_messages(p)
             if FLAG.search(text)]
    assert not found, "\n".join(found)


def test_the_cli_adds_the_flag_of_the_input_at_fault(cli):
    proc = cli("plan", "--model", "tiny-moe", "--topology", "local-cpu", "--tokens", "1e9", "--usable-gpus", "9")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "error: --usable-gpus: usable GPUs per domain must lie in 1..4" in proc.stderr
