"""The Textual UI, driven headless with App.run_test (no pytest-asyncio: each test runs its own asyncio.run).

Runs a real layout search (tiny-moe on local-cpu, about 2 s) in the UI's child process, sorts, opens a detail and
saves the plan (checked against `rackcast plan --out` for the same inputs); cancels a running search (Marin on 11
racks, which runs ~30 s); checks inline messages for bad input; and checks each screen's 80x24 text capture
(rackcast.tui.capture, the same captures as docs/tui/*.txt) for its key content.

    .venv/bin/pytest -q tests/test_tui.py
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import time

import pytest

from rackcast.plan import load_plan, plan_to_yaml
from rackcast.tui import capture
from rackcast.tui.app import RackcastApp
from rackcast.tui.widgets import Field, pipeline_gantt

SIZE = (80, 24)


async def _wait(pilot, cond, timeout: float = 40.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out waiting for the UI")
        await pilot.pause(0.1)


def _cli_plan(tmp_path, inputs: dict) -> str:
    """`rackcast plan ... --out FILE` for the same inputs, in this process."""
    from rackcast.cli import plan as plan_cli

    parser = argparse.ArgumentParser()
    plan_cli.register(parser.add_subparsers())
    out = tmp_path / "cli.yaml"
    args = parser.parse_args(["plan", "--model", inputs["model"], "--topology", inputs["topology"], "--racks",
                              inputs["racks"], "--tokens", inputs["tokens"], "--start", inputs["start"],
                              "--deadline", inputs["deadline"], "--out", str(out)])
    assert args.func(args) == 0
    return str(out)


def _without_command(plan):
    """Provenance records the command line that made the plan; the TUI records the equivalent `rackcast plan`
    line, which differs from any particular shell invocation (e.g. --out), so it is left out of the comparison."""
    return dataclasses.replace(plan, provenance=dataclasses.replace(plan.provenance, command=""))


def test_search_sort_detail_save(tmp_path):
    inputs = capture.PLAN_INPUTS

    async def run():
        app = RackcastApp(plan_defaults=inputs)
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            await pilot.press("ctrl+r")
            assert screen.job is not None
            await _wait(pilot, lambda: screen.result is not None)
            table = screen.query_one("DataTable")
            assert table.row_count == len(screen.result.ranked) > 10
            from rackcast.tui.plan_screen import COLUMNS

            steps = [key for _, key in COLUMNS].index("tokens_per_s")
            await pilot.press(*["s"] * steps)  # rank -> layout -> ... -> tokens/s (descending first)
            assert screen.sort_key == "tokens_per_s" and screen.sort_reverse
            shown = [table.get_row_at(i)[0] for i in range(table.row_count)]
            by_rank = {str(r.rank): r.best_tokens_per_s for r in screen.result.ranked}
            assert [by_rank[x] for x in shown] == sorted(by_rank.values(), reverse=True)
            await pilot.press("S")
            assert not screen.sort_reverse
            screen.sort_by("rank")
            assert not screen.sort_reverse
            table.move_cursor(row=0)
            await pilot.press("enter")
            detail = app.screen
            assert type(detail).__name__ == "DetailScreen" and detail.row.rank == 1
            await _wait(pilot, lambda: detail.data is not None)
            await pilot.press("ctrl+s")
            path_input = detail.query_one("#save-path")
            path_input.value = str(tmp_path / "tui.yaml")
            await pilot.press("enter")
            await pilot.pause()
            assert "saved" in str(detail.query_one("#save-msg").render())
            path_input.value = str(tmp_path / "no-such-dir" / "x.yaml")
            await pilot.press("enter")
            await pilot.pause()
            assert "not a folder" in str(detail.query_one("#save-msg").render())
            await pilot.press("escape")
            assert app.screen is screen

    asyncio.run(run())
    saved = load_plan(str(tmp_path / "tui.yaml"))
    cli = load_plan(_cli_plan(tmp_path, inputs))
    assert saved.predicted is not None and saved.provenance is not None
    assert saved.provenance.command.startswith("rackcast plan --model tiny-moe")
    assert plan_to_yaml(_without_command(saved)) == plan_to_yaml(_without_command(cli))


def test_cancel_running_search():
    async def run():
        app = RackcastApp()  # Marin 535B on 11 GB200 racks: a search of ~30 s
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            await pilot.press("ctrl+r")
            job = screen.job
            await pilot.pause(1.0)
            assert not job.finished and job.process.poll() is None
            await pilot.press("escape")
            assert job.finished and job.process.poll() is not None
            with pytest.raises(ProcessLookupError):  # the whole group (search + its pool) is gone
                for _ in range(30):
                    os.killpg(job.process.pid, 0)
                    time.sleep(0.1)
            assert "cancelled" in str(screen.query_one("#status").render())
            assert screen.result is None

    asyncio.run(run())


def test_bad_input_is_an_inline_message():
    async def run():
        app = RackcastApp(plan_defaults={**capture.PLAN_INPUTS, "racks": "two", "deadline": "2025-01-01"})
        async with app.run_test(size=SIZE) as pilot:
            screen = app.screen
            await pilot.press("enter")  # enter in the focused field runs the search
            await pilot.pause()
            assert screen.job is None
            assert "whole number" in str(screen.query_one("#field-racks", Field).query_one(".error").render())
            assert "not after" in str(screen.query_one("#field-deadline", Field).query_one(".error").render())
            screen.query_one("#width").value = "wide"
            await pilot.press("ctrl+r")
            await pilot.pause()
            assert "whole number" in str(screen.query_one("#field-width", Field).query_one(".error").render())
            await pilot.press("f4")
            cmp = app.screen
            cmp.query_one("#cmp-plan").value = "missing.yaml"
            await pilot.press("ctrl+r")
            await pilot.pause()
            assert "no such file" in str(cmp.query_one("#field-cmp-plan", Field).query_one(".error").render())

    asyncio.run(run())


@pytest.fixture(scope="module")
def screens():
    return capture.captures()


@pytest.mark.parametrize("name, expected", [
    ("plan", ["tiny-moe", "local-cpu", "tok/s", "MFU", "mem", "P50 d", "meets", "mb", "ranked of", "^r Run"]),
    ("detail", ["Candidate", "tokens/s", "days to the deadline", "band +-", "Memory per GPU", "HBM",
                "Step time by phase"]),
    ("detail-gantt", ["rank 0", "rank 1", "micro-batch", "nvlink ep", "D=dispatch", "C=combine"]),
    ("size", ["dense-gpt", "deadline", "Pareto", "B params", "best layout", "nothing fits"]),
    ("compare", ["predicted", "measured", "step_time_s", "tokens_per_s", "step time per step"]),
    ("help", ["rackcast TUI", "Plan", "Detail", "Size", "Compare"]),
])
def test_screen_captures(screens, name, expected):
    text = screens[name]
    lines = text.splitlines()
    assert len(lines) == SIZE[1] and max(len(x) for x in lines) <= SIZE[0]
    for word in expected:
        assert word in text, f"{name}: {word!r} not on screen:\n{text}"


def test_pipeline_gantt_draws_every_action():
    from rackcast.simulator.pipeline_exec import ChunkDurations, run_pipeline

    res = run_pipeline("1f1b", 4, 8, 1, ChunkDurations.uniform(1.0))
    lines = pipeline_gantt(res.timelines, res.total_s, width=int(res.total_s)).plain.splitlines()
    assert all(ln.startswith(f"rank {i} │") for i, ln in enumerate(lines[:4]))
    # one cell per unit of time: each rank does 8 forwards (1 cell) and 8 full backwards (2 cells)
    cells = [ln.split("│", 1)[1] for ln in lines[:4]]
    assert all(sum(c != "·" for c in row) == 8 * 3 for row in cells)


def test_light_theme_and_help():
    async def run():
        app = RackcastApp(theme="textual-light")
        async with app.run_test(size=SIZE) as pilot:
            assert not app.current_theme.dark
            await pilot.press("ctrl+t")
            assert app.current_theme.dark
            await pilot.press("f1")
            assert type(app.screen).__name__ == "HelpScreen"
            await pilot.press("escape")
            assert type(app.screen).__name__ == "PlanScreen"

    asyncio.run(run())


def test_detail_of_a_candidate_too_large_to_simulate_shows_the_estimate_and_why(monkeypatch):
    from rackcast.planner import search as S
    from rackcast.simulator import step
    from rackcast.tui.detail_screen import render_detail
    from rackcast.tui.planning import detail

    result = S.search(S.Request(model="tiny-moe", topology="local-cpu", racks=1, tokens=1e9, top=0, simulate=False,
                                workers=1))
    monkeypatch.setattr(step, "MAX_LAYER_PASSES", 1)  # past simulate's work bound
    d = detail(result, result.winner)
    assert d.sim is None and d.source == "estimate" and "not simulated: batch.global_batch" in d.sim_note
    text = "\n".join(f"{title}\n{body.plain}" for title, body in render_detail(d))
    assert "not simulated" in text and "closed-form estimate" in text
