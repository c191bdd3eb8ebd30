"""Atomic file writes, the one home for them: a file appears whole or not at all (an interrupted write, an error or
Ctrl-C leaves the old file, or none, and no temporary behind).

`atomic_path(path)` yields a temporary sibling of `path` for any writer (pyarrow, numpy, torch.save) and renames it
over `path` when the block ends without an error (os.replace is atomic within one file system); the helpers below
write text, bytes and JSON through it.

    with atomic_path("metrics.parquet") as tmp:
        pyarrow.parquet.write_table(table, tmp)
    write_text_atomic("plan.yaml", text)
"""

from __future__ import annotations

import json
import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A fresh temporary path beside `path`; renamed over `path` on success, removed on any exception. The name is
    unique per call (process id and a random part), so concurrent writers of one file never share a temporary."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_json_atomic(path: str | Path, data: Any, indent: int | None = 2, sort_keys: bool = False) -> None:
    """`data` as JSON text with a final newline."""
    write_text_atomic(path, json.dumps(data, indent=indent, sort_keys=sort_keys) + "\n")
