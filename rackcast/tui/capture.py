"""Text captures of the TUI's screens at 80x24 with fixed inputs, for the README (docs/tui/*.txt) and the tests.

Each screen is driven headless (App.run_test), its SVG screenshot (App.export_screenshot) is turned back into the
characters on screen, and written as plain text.

    python -m rackcast.tui.capture docs/tui [RUN_DIR]
"""

from __future__ import annotations

import asyncio
import html
import re
import sys
import tempfile
from pathlib import Path

from rackcast.atomic import write_json_atomic, write_text_atomic

CHAR_WIDTH_PX = 12.2  # rich's SVG export: 0.61 x the 20 px font size
SIZE = (80, 24)
PLAN_INPUTS = {"model": "tiny-moe", "topology": "local-cpu", "racks": "1", "tokens": "1e9", "start": "2026-01-05",
               "deadline": "2026-01-12"}
SIZE_INPUTS = {"family": "dense-gpt", "topology": "h100-hgx", "racks": "1", "tokens": "1e10", "start": "2026-01-05",
               "deadline": "2026-01-07"}
COMPARE_PLAN = "examples/plans/tiny-1proc.yaml"
_TEXT = re.compile(r'<text class="[^"]*" x="([\d.]+)" y="[\d.]+" textLength="[\d.]+" '
                   r'clip-path="url\(#[^)]*-line-(\d+)\)">(.*?)</text>')


def svg_text(svg: str) -> str:
    """The characters of an exported screenshot, one line per terminal row."""
    rows: dict[int, list[tuple[float, str]]] = {}
    for x, line, text in _TEXT.findall(svg):
        rows.setdefault(int(line), []).append((float(x), html.unescape(text).replace("\xa0", " ")))
    out = []
    for line in range(max(rows, default=-1) + 1):
        text = ""
        for x, part in sorted(rows.get(line, [])):
            text = text.ljust(round(x / CHAR_WIDTH_PX)) + part
        out.append(text.rstrip())
    return "\n".join(out) + "\n"


def screen_text(app) -> str:
    return svg_text(app.export_screenshot())


def size_options():
    """A small space for the size search (seconds, not minutes): one node, few degrees and knobs."""
    from rackcast.planner.space import SpaceOptions

    return {"workers": 1, "top": 1, "options": SpaceOptions.coarse(
        max_pipeline=2, contexts=(1,), max_micro_batch=1, schedules=("1f1b",), recompute=("none",),
        opt_locations=("hbm",))}


def plan_result():
    """The layout search for PLAN_INPUTS, run here (the screen runs the same request in a child process)."""
    from rackcast.tui.jobs import run_search
    from rackcast.tui.planning import build_request

    return run_search(build_request(PLAN_INPUTS), lambda *a: None).restore()


def size_result():
    from rackcast.tui.jobs import run_size
    from rackcast.tui.planning import build_size_request

    return run_size(build_size_request(SIZE_INPUTS, **size_options()), lambda *a: None).restore()


def synthetic_run(folder: Path, plan_path: str = COMPARE_PLAN, steps: int = 12) -> Path:
    """A run folder in backend.record's format with fixed numbers (for tests and captures without training)."""
    import math

    from rackcast.backend.record import summary, write_metrics
    from rackcast.vocab import MEASURED_PHASES as PHASES

    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(steps):
        step_s = 0.30 if i == 0 else 0.12 + 0.004 * ((i * 7) % 5)
        row = {"step": i + 1, "loss": 5.5 - 0.1 * i, "ce": 5.5 - 0.1 * i, "z_loss": 0.0, "eval_loss": math.nan,
               "lr": 0.01, "step_time_s": step_s, "tokens_per_s": 1024 / step_s, "mfu": 0.2,
               "peak_memory_bytes": 600e6, "drop_fraction": 0.0, "plan_hash": "synthetic"}
        row.update({f"phase_{p}_s": (0.7 * step_s if p == "compute" else 0.3 * step_s if p == "optimizer" else 0.0)
                    for p in PHASES})
        rows.append(row)
    write_metrics(folder, rows)
    write_json_atomic(folder / "record.json", summary(rows, plan="tiny-1proc", plan_path=plan_path,
                                                       device="cpu", peak_flops=103e9, peak_flops_bf16=225e9))
    return folder


async def settled(pilot, app, tries: int = 100, pause_s: float = 0.1, agree: int = 3) -> str:
    """The screen's text once `agree` captures in a row, `pause_s` apart, are the same: a table whose rows just
    arrived widens its columns on a later refresh, which a loaded machine can delay past any fixed pause."""
    text, same = screen_text(app), 1
    for _ in range(tries):
        await pilot.pause(pause_s)
        now = screen_text(app)
        same = same + 1 if now == text else 1
        text = now
        if same >= agree:
            break
    return text


async def _captures(run_dir: str) -> dict[str, str]:
    from rackcast.tui.app import RackcastApp
    from rackcast.tui.detail_screen import DetailScreen
    from rackcast.tui.planning import detail

    out = {}
    presult, sresult = plan_result(), size_result()
    app = RackcastApp(plan_defaults=PLAN_INPUTS, size_defaults=SIZE_INPUTS, compare_paths=(COMPARE_PLAN, run_dir))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        plan = app.screen
        plan.show_result(presult)
        await pilot.pause()
        out["plan"] = screen_text(app)
        row = presult.ranked[0]
        app.push_screen(DetailScreen(presult, row, detail(presult, row)))
        await pilot.pause()
        out["detail"] = screen_text(app)
        gantt_row = next((r for r in presult.ranked if r.layout.parallel.pipeline > 1), row)
        if gantt_row is not row:  # the pipeline schedule's gantt needs a pipelined candidate: the best one
            app.pop_screen()
            app.push_screen(DetailScreen(presult, gantt_row, detail(presult, gantt_row)))
            await pilot.pause()
        app.screen.query_one("#body").scroll_to_widget(app.screen.query_one("#sec-pipeline"), animate=False, top=True)
        await pilot.pause()
        out["detail-gantt"] = screen_text(app)
        app.pop_screen()
        await pilot.press("f3")
        await pilot.pause()
        app.screen.show_result(sresult)
        await pilot.pause()
        out["size"] = screen_text(app)
        await pilot.press("f4")
        for _ in range(400):  # the prediction is simulated in a worker thread
            await pilot.pause(0.05)
            if getattr(app.screen, "comparison", None) is not None:
                break
        out["compare"] = await settled(pilot, app)
        await pilot.press("f1")
        await pilot.pause()
        out["help"] = screen_text(app)
    return out


def captures(run_dir: str = "") -> dict[str, str]:
    """Screen name -> its text at 80x24; without a run folder, the compare screen reads a synthetic one."""
    if run_dir:
        return asyncio.run(_captures(run_dir))
    with tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(_captures(str(synthetic_run(Path(tmp) / "run"))))


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else "docs/tui")
    out.mkdir(parents=True, exist_ok=True)
    for name, text in captures(argv[1] if len(argv) > 1 else "").items():
        write_text_atomic(out / f"{name}.txt", text)
        print(f"wrote {out / name}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
