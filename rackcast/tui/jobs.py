"""Background jobs for the TUI: planner work runs in a child Python process (its own session, so cancelling ends
it and the search's worker pool together) and reports progress and its result over a pipe. The interface stays
responsive and a search can be cancelled at any time.

A plain subprocess rather than multiprocessing: under Textual, stderr is not a real file, and multiprocessing's
resource tracker then fails to start. No textual import here: the child imports this module and the planner only.

    job = Job("rackcast.tui.jobs:run_search", request).start()
    for kind, *payload in job.poll(): ...   # ("progress", done, total, what) | ("done", value) | ("error", text)
    job.cancel()
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import pickle
import queue
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from rackcast.errors import RackcastError

TABLE_ROWS = 200  # ranked candidates sent back to the table (the search ranks thousands for big models)
ROOT = str(Path(__file__).resolve().parents[2])


def _send(stream, message) -> None:
    data = pickle.dumps(message)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read(stream):
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(n))  # our own child's output, never outside data


def child_main() -> int:
    """The child: read (target, args) from stdin, run target(*args, progress=...), write messages to stdout."""
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the message stream
    target, args = pickle.load(sys.stdin.buffer)
    module, _, name = target.partition(":")
    fn = getattr(importlib.import_module(module), name)

    def progress(done, total, what: str = "") -> None:
        _send(out, ("progress", done, total, what))

    try:
        _send(out, ("done", fn(*args, progress=progress)))
    except RackcastError as exc:
        _send(out, ("error", str(exc)))
    except Exception as exc:  # shown in the status line: the UI must never die of a planner error
        _send(out, ("error", f"{type(exc).__name__}: {exc}"))
    return 0


class Job:
    """target(*args, progress=callback) in a child process; target is 'module:function'."""

    def __init__(self, target: str, *args) -> None:
        self.target, self.args = target, args
        self.messages: queue.Queue = queue.Queue()
        self.process: subprocess.Popen | None = None
        self.finished = False
        self._stderr = tempfile.TemporaryFile()

    def start(self) -> "Job":
        self.process = subprocess.Popen([sys.executable, "-m", "rackcast.tui.jobs"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._stderr,
                                        start_new_session=True)
        self.process.stdin.write(pickle.dumps((self.target, self.args)))
        self.process.stdin.close()
        threading.Thread(target=self._reader, daemon=True).start()
        return self

    def _reader(self) -> None:
        stream = self.process.stdout
        while True:
            try:
                msg = _read(stream)
            except (OSError, ValueError, EOFError, pickle.UnpicklingError):
                msg = None
            if msg is None:
                self.messages.put(("eof",))
                return
            self.messages.put(msg)

    def poll(self) -> list[tuple]:
        """Messages so far, without blocking. A child that ended without a result reports an error."""
        msgs = []
        while True:
            try:
                msg = self.messages.get_nowait()
            except queue.Empty:
                break
            if msg[0] == "eof":
                if not self.finished:
                    msgs.append(("error", self._died()))
                self.finished = True
                continue
            if msg[0] in ("done", "error"):
                self.finished = True
            msgs.append(msg)
        return msgs

    def _died(self) -> str:
        code = self.process.wait(timeout=5)
        self._stderr.seek(0)
        tail = self._stderr.read().decode(errors="replace").strip().splitlines()[-1:]
        return f"the worker process stopped (exit code {code}){': ' + tail[0] if tail else ''}"

    def cancel(self) -> None:
        if self.finished or self.process is None:
            return
        self.finished = True
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=3)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=3)

    def wait(self, timeout: float = 60.0) -> None:
        """Block until the child is done (tests and scripts)."""
        self.process.wait(timeout=timeout)


# ---------------------------------------------------------------- targets (run in the child process)
@dataclass
class SearchOutcome:
    """A search Result trimmed for the UI. Result keys its forecast by id(row), which pickling does not keep, so the
    per-row forecast travels as lists in ranked order and `restore` rebuilds the dicts on this side."""

    result: object  # planner.search.Result with rows=[] and ranked[:TABLE_ROWS]
    days: list[float] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    has_forecast: list[bool] = field(default_factory=list)
    total_ranked: int = 0

    def restore(self):
        r = self.result
        r.forecast_days, r.deadline_prob = {}, {}
        for row, days, prob, has in zip(r.ranked, self.days, self.probs, self.has_forecast):
            if has:
                r.forecast_days[id(row)] = days
                r.deadline_prob[id(row)] = prob
        return r


def _call(fn, progress, *args):
    """fn(*args, progress=...) where fn takes a progress callback, else fn(*args) with stage-only progress."""
    if "progress" in getattr(inspect.signature(fn), "parameters", {}):
        return fn(*args, progress=progress)
    progress(0, 0, "searching")
    return fn(*args)


def run_search(request, progress) -> SearchOutcome:
    from rackcast.planner.rows import Rejected
    from rackcast.planner.search import search

    result = _call(search, progress, request)
    ranked = result.ranked[:TABLE_ROWS]
    keep = {id(x) for x in ranked}
    out = SearchOutcome(result=None, total_ranked=len(result.ranked))
    for row in ranked:
        out.has_forecast.append(id(row) in result.forecast_days)
        out.days.append(result.forecast_days.get(id(row), math.nan))
        out.probs.append(result.deadline_prob.get(id(row), math.nan))
    result.ranked = ranked
    result.evaluated = [x for x in result.evaluated if id(x) in keep]
    result.rejected = Rejected()  # the refused layouts are never kept (nor sent back through the pipe)
    out.result = result
    return out


def run_size(kwargs: dict, progress) -> "SizeOutcome":
    """planner.size.size_search(**kwargs), each shape's result trimmed to its best layout."""
    from rackcast.planner import size
    from rackcast.planner.rows import Rejected

    result = _call(lambda: size.size_search(**kwargs), progress)
    out = SizeOutcome(result=result)
    for s in result.shapes:
        r = s.result
        out.days.append(s.days)
        if r is not None:
            out.probs.append(r.deadline_prob.get(id(s.best), math.nan))
            r.ranked, r.evaluated, r.rejected = r.ranked[:1], [], Rejected()
        else:
            out.probs.append(math.nan)
    return out


@dataclass
class SizeOutcome:
    """A planner.size.SizeResult with each shape's forecast carried in lists (see SearchOutcome)."""

    result: object
    days: list[float] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)

    def restore(self):
        for s, days, prob in zip(self.result.shapes, self.days, self.probs):
            if s.result is not None:
                s.result.forecast_days = {id(s.best): days} if not math.isinf(days) else {}
                s.result.deadline_prob = {id(s.best): prob}
        return self.result


if __name__ == "__main__":
    sys.exit(child_main())
