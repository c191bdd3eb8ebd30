"""Hardening (issue 18): every bad input is one line and exit code 2, through every front end; numbers, names,
paths, dates and seeds are bounded when they are read; long computations check a work bound first; compare refuses
a run of another plan and says when the topology is uncalibrated. One regression test per failure the issue lists,
end to end through the CLI (rackcast.cli.main in this process) where the issue showed a CLI symptom.

    .venv/bin/pytest -q tests/test_hardening.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from conftest import PLANS, ROOT
from rackcast.cli import main
from rackcast.errors import RackcastError
from rackcast.modelspec import ModelSpec
from rackcast.plan import Plan, inputs_hash, load_plan
from rackcast.strict import bounds_markdown, load_yaml, parse_yaml, unbounded_numbers
from rackcast.topologies.profiles import StackProfile
from rackcast.topologies.reliability import ReliabilitySpec
from rackcast.topologies.spec import Topology

TINY = PLANS / "tiny-1proc.yaml"
BOUNDED_FILES = {"plan": Plan, "model": ModelSpec, "topology": Topology, "reliability": ReliabilitySpec,
                 "stack profile": StackProfile}


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = main(list(args))
    except SystemExit as exc:  # argparse's own refusals (one line, exit code 2)
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _refused(capsys, *args: str) -> str:
    """Run the CLI, check it refused in one line with exit code 2, and return that line."""
    code, _, err = _cli(capsys, *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err[-2000:])
    assert "Traceback" not in err and len(lines[0]) < 500
    return lines[0]


def _text_plan(tmp_path, old: str, new: str, source=TINY, name="plan.yaml") -> str:
    """The plan `source` with one piece of its YAML text replaced (so unquoted YAML forms can be written)."""
    text = source.read_text()
    assert old in text
    path = tmp_path / name
    path.write_text(text.replace(old, new))
    return str(path)


def _file_plan(tmp_path, kind: str, edit) -> str:
    """tiny-1proc naming a copy of its model (kind='model') or topology file, edited by `edit(text) -> text`."""
    src = ROOT / ("rackcast/model_presets/tiny-moe.yaml" if kind == "model" else "topologies/presets/local-cpu.yaml")
    target = tmp_path / f"{kind}.yaml"
    target.write_text(edit(src.read_text()))
    data = load_yaml(TINY)
    if kind == "model":
        data["model"] = str(target)
    else:
        data["topology"]["name"] = str(target)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


# ------------------------------------------------------------------------------------------------ numbers
@pytest.mark.parametrize("old, new, message", [
    ("global_batch: 8", "global_batch: 1.0e300", "batch.global_batch: 1e+300 is outside [1, 16,777,216]"),
    ("global_batch: 8", "global_batch: '1e7'", "batch.global_batch: expected int, got '1e7'"),
    ("global_batch: 8", "global_batch: 8.5", "batch.global_batch: expected int, got 8.5"),
    ("tokens: 1.0e6", "tokens: 1.0e300", "tokens: 1e+300 is outside [0, 1e+18]"),
    ("tokens: 1.0e6", "tokens: .nan", "tokens: must be a number, got NaN"),
    ("tokens: 1.0e6", "tokens: .inf", "tokens: must be finite, got inf"),
    ("lr: 0.01", "lr: .nan", "optimizer.lr: must be a number, got NaN"),
    ("tokens: 1.0e6", "tokens: 1.0e6\nexpert_transport: {mode: capacity, capacity_factor: .nan}",
     "expert_transport.capacity_factor: must be a number, got NaN"),
    ("tokens: 1.0e6", "tokens: 1.0e6\nseed: 1000000000000000000000000000000",
     "seed: 1000000000000000000000000000000 is outside [0, 4,294,967,295]"),
    ("usable_gpus: 1", "usable_gpus: 1\n  domains: 4",
     "topology: domains: local-cpu has no scale-out fabric (scale_out.nics_per_gpu: 0), so it is one node only"),
])
def test_plan_numbers_are_typed_finite_and_bounded_in_one_line(tmp_path, capsys, old, new, message):
    line = _refused(capsys, "estimate", _text_plan(tmp_path, old, new))
    assert message in line and "plan.yaml" in line


def test_local_cpu_on_four_domains_is_refused_by_estimate_and_simulate_alike(tmp_path, capsys):
    text = TINY.read_text().replace("  domains: 1\n", "  domains: 4\n")
    path = tmp_path / "plan.yaml"
    path.write_text(text)
    for command in ("estimate", "simulate"):
        assert "domains: local-cpu has no scale-out fabric" in _refused(capsys, command, str(path))


@pytest.mark.parametrize("old, new, message", [
    ("layers: 4", "layers: 1.0e30", "layers: 1e+30 is outside [1, 1,024]"),
    ("layers: 4", "layers: 1000003", "layers: 1,000,003 is outside [1, 1,024]"),
    ("d_model: 64", "d_model: 1.0e300", "d_model: 1e+300 is outside"),
    ("experts: 8", "experts: 100000000", "moe.experts: 100,000,000 is outside [1, 16,384]"),
])
def test_model_numbers_are_bounded_before_any_computation(tmp_path, capsys, old, new, message):
    line = _refused(capsys, "estimate", _file_plan(tmp_path, "model", lambda t: t.replace(old, new)))
    assert "model.yaml" in line and message.replace(",", "") in line.replace(",", "")


@pytest.mark.parametrize("old, new, message", [
    ("  latency_s: 1.0e-4", "  latency_s: .inf", "scale_up.latency_s: must be finite, got inf"),
    ("  oversubscription: 1.0", "  oversubscription: .nan", "scale_out.oversubscription: must be a number, got NaN"),
    ("  hbm_bytes: 6319128576", "  hbm_bytes: -1", "accelerator.hbm_bytes: -1 is outside (0,"),
    ("    bf16: 225.0e9", "    fp16: 225.0e9", "accelerator.peak_flops.bf16: required"),  # fuzz #5062 (ValueError)
])
def test_topology_numbers_are_bounded(tmp_path, capsys, old, new, message):
    def edit(text):
        assert old in text
        return text.replace(old, new, 1)

    line = _refused(capsys, "estimate", _file_plan(tmp_path, "topology", edit))
    assert "topology.yaml" in line and message in line


def test_yaml_1_2_floats_are_floats_and_strings_that_look_like_numbers_stay_strings():
    assert parse_yaml("a: 1e7\nb: 1.0e300\nc: '1e7'\nd: 2026-09-01\ne: 12") == \
        {"a": 1e7, "b": 1e300, "c": "1e7", "d": "2026-09-01", "e": 12}


def test_every_numeric_field_of_every_input_file_has_a_range():
    for cls in BOUNDED_FILES.values():
        assert unbounded_numbers(cls) == []


def test_readme_bounds_table_is_the_one_generated_from_the_fields():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- input-bounds:start -->\n")[1].split("\n<!-- input-bounds:end -->")[0]
    assert block == bounds_markdown(BOUNDED_FILES, skip=("model.",))


# ------------------------------------------------------------------------------------------------ text
def test_non_utf8_bytes_are_one_line_in_every_loader(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_bytes(TINY.read_bytes().replace(b"tiny-1proc", b"tiny-\xff"))
    assert "not UTF-8 text (byte 0xff" in _refused(capsys, "estimate", str(path))
    model = _file_plan(tmp_path, "model", lambda t: t)
    (tmp_path / "model.yaml").write_bytes((tmp_path / "model.yaml").read_bytes() + b"# caf\xe9\n")
    assert "model.yaml: not UTF-8 text" in _refused(capsys, "estimate", model)


def test_a_5000_character_model_name_is_refused_in_one_line(tmp_path, capsys):
    line = _refused(capsys, "estimate", _text_plan(tmp_path, "model: tiny-moe", "model: " + "a" * 5000))
    assert "model: 5000 characters, at most 4096 allowed" in line


def test_a_model_name_with_a_path_separator_is_a_path_not_a_preset(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _refused(capsys, "estimate", _text_plan(tmp_path, "model: tiny-moe",
                                                   "model: ../../topologies/presets/h100-hgx"))
    assert line.endswith("plan.yaml: model: ../../topologies/presets/h100-hgx: file not found")
    with pytest.raises(RackcastError, match="unknown model preset '..h100-hgx'"):
        from rackcast.presets import load_model
        load_model("..h100-hgx")


def test_an_alias_bomb_in_a_typed_field_is_refused_fast_in_a_short_line(tmp_path, capsys):
    bomb = "".join(f"b{i}: &b{i} [{', '.join(['*b%d' % (i - 1) if i else '1'] * 9)}]\n" for i in range(9))
    path = tmp_path / "plan.yaml"
    path.write_text(bomb.replace("b", "x") + TINY.read_text().replace("global_batch: 8", "global_batch: *x8"))
    line = _refused(capsys, "estimate", str(path))
    assert "aliases are expanded" in line
    small = tmp_path / "small.yaml"  # under the expansion bound, the typed field's error quotes a cut value
    small.write_text(TINY.read_text().replace("global_batch: 8", "global_batch: [&x0 [1, 2, 3, 4, 5, 6, 7, 8], "
                                                                 "*x0, *x0, *x0, *x0]"))
    assert "batch.global_batch: expected int, got [[1, 2, 3, 4, ...]" in _refused(capsys, "estimate", str(small))


def test_deep_nesting_is_refused_without_recursion(tmp_path, capsys):
    path = tmp_path / "plan.yaml"
    path.write_text(TINY.read_text() + "bogus: " + "[" * 200_000 + "]" * 200_000 + "\n")
    assert "nested more than 64 levels deep" in _refused(capsys, "estimate", str(path))


# ------------------------------------------------------------------------------------------------ dates
@pytest.mark.parametrize("dates, message", [
    ("start: '2026-13-45'", "start: expected an ISO date YYYY-MM-DD, got '2026-13-45'"),
    ("start: 2026-13-45", "start: expected an ISO date YYYY-MM-DD, got '2026-13-45'"),
    ("start: 2026-05-01\ndeadline: 2026-04-01", "deadline: 2026-04-01 is not after the start 2026-05-01"),
    ("start: 9999-12-01", "start: year 9999 is outside 1970..2200"),
])
@pytest.mark.parametrize("command", ["estimate", "simulate", "forecast", "train"])
def test_bad_dates_are_refused_by_every_command_at_load(tmp_path, capsys, dates, message, command):
    path = _text_plan(tmp_path, "tokens: 1.0e6", "tokens: 1.0e6\n" + dates)
    line = _refused(capsys, command, path, *(["--steps", "1", "--out", str(tmp_path / "run")]
                                             if command == "train" else []))
    assert message in line and "plan.yaml" in line


# ------------------------------------------------------------------------------------------------ one line
def test_python_m_rackcast_plan_refuses_in_one_line_with_exit_code_2(tmp_path):
    bad = _text_plan(tmp_path, "global_batch: 8", "global_batch: 1.0e300")
    result = subprocess.run([sys.executable, "-m", "rackcast.plan", str(TINY), bad], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [f"rackcast.plan: error: {bad}: batch.global_batch: 1e+300 is "
                                                  "outside [1, 16,777,216]"]
    assert result.stdout == f"{TINY}: ok\n"


def test_an_unexpected_error_is_one_line_pointing_at_debug_which_shows_the_traceback(capsys, monkeypatch):
    import rackcast.simulator.estimate as estimate_module

    def broken(*args, **kwargs):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(estimate_module, "estimate", broken)
    code, _, err = _cli(capsys, "estimate", str(TINY))
    assert code == 1 and err.strip().splitlines() == [
        "rackcast estimate: internal error: ZeroDivisionError: float division by zero (rerun with "
        "`rackcast --debug estimate ...` for the traceback)"]
    with pytest.raises(ZeroDivisionError):
        main(["--debug", "estimate", str(TINY)])


def test_the_tui_front_end_turns_an_unexpected_error_into_one_line(capsys, monkeypatch):
    from rackcast.tui import app as tui_app

    def broken(self, *args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(tui_app.RackcastApp, "run", broken)
    assert tui_app.main([]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "rackcast tui: internal error: KeyError: 'boom' (rerun with --debug for the traceback)"]
    with pytest.raises(KeyError):
        tui_app.main(["--debug"])


# ------------------------------------------------------------------------------------------------ seeds
def test_seeds_are_bounded_on_the_command_line_and_in_the_plan(tmp_path, capsys):
    assert "argument --seed: -5 is outside [0, 4,294,967,295]" in _refused(capsys, "simulate", "--seed", "-5",
                                                                          str(TINY))
    assert "--seed: 4294967296 is outside" in _refused(capsys, "forecast", str(TINY), "--seed", str(2**32),
                                                       "--start", "2026-01-01")
    plan = _text_plan(tmp_path, "tokens: 1.0e6", "tokens: 1.0e6\nseed: 1000000000000000000000000000000")
    assert "seed: 1000000000000000000000000000000 is outside" in _refused(
        capsys, "train", plan, "--steps", "1", "--out", str(tmp_path / "run"))


def test_command_line_numbers_take_the_plan_fields_bounds(capsys):
    assert "argument --tokens: must be a number, got NaN" in _refused(
        capsys, "plan", "--model", "tiny-moe", "--topology", "local-cpu", "--tokens", "nan")
    assert "--tokens: 1e+300 is outside [0, 1e+18]" in _refused(capsys, "forecast", str(TINY), "--tokens", "1e300",
                                                                "--start", "2026-01-01")
    assert "argument --racks: 0 is outside [1, 65,536]" in _refused(capsys, "topologies", "show", "local-cpu",
                                                                    "--racks", "0")


# ------------------------------------------------------------------------------------------------ work bounds
def test_simulate_refuses_a_step_beyond_its_work_bound_naming_the_field(tmp_path, capsys):
    path = _text_plan(tmp_path, "  global_batch: 8\n  micro_batch: 4", "  global_batch: 65536\n  micro_batch: 1")
    line = _refused(capsys, "simulate", path)
    assert "batch.global_batch: 65,536 micro-batches x 4 layers = 262,144 layer passes per step; simulate runs at " \
           "most 32,768" in line


def test_forecast_refuses_a_budget_beyond_its_horizon_naming_tokens(capsys):
    line = _refused(capsys, "forecast", str(TINY), "--tokens", "1e18", "--start", "2026-01-01")
    assert "tokens: 1e+18 tokens at" in line and "the forecast covers at most 3,650 days" in line


# ------------------------------------------------------------------------------------------------ JSON
def test_json_output_has_no_nan_when_the_plan_has_no_token_budget(tmp_path, capsys):
    path = _text_plan(tmp_path, "tokens: 1.0e6\n", "")
    code, out, _ = _cli(capsys, "estimate", path, "--json")

    def refuse(constant):
        raise AssertionError(f"JSON holds {constant}")

    assert code == 0 and json.loads(out, parse_constant=refuse)["days_to_budget"] is None


# ------------------------------------------------------------------------------------------------ compare
def _record(tmp_path, plan_path) -> str:
    run = tmp_path / "run"
    run.mkdir()
    plan = load_plan(str(plan_path))
    (run / "record.json").write_text(json.dumps({
        "plan": plan.name, "plan_hash": inputs_hash(plan), "step_time_s": 0.5, "tokens_per_s": 1000.0,
        "phases_s": {"compute": 0.4}, "peak_memory_bytes": 1e8, "drop_fraction": 0.0}))
    return str(run)


def test_compare_refuses_a_run_of_another_plan_unless_forced(tmp_path, capsys):
    run = _record(tmp_path, PLANS / "tiny-2proc-ep.yaml")
    line = _refused(capsys, "compare", str(TINY), run)
    assert "record.json: this run trained another plan (tiny-2proc-ep" in line and "--force" in line
    code, out, _ = _cli(capsys, "compare", str(TINY), run, "--force", "--estimate", "--json")
    assert code == 0 and json.loads(out)["plan"] == "tiny-1proc"


def test_compare_says_when_the_topology_is_uncalibrated(tmp_path, capsys):
    run = _record(tmp_path, TINY)
    code, out, _ = _cli(capsys, "compare", str(TINY), run, "--estimate")
    assert code == 0 and "topology local-cpu is not calibrated" in out and "rackcast calibrate" in out
    code, out, _ = _cli(capsys, "compare", str(TINY), run, "--estimate", "--json")
    assert json.loads(out)["calibrated"] is False


@pytest.mark.parametrize("counts, message", [
    ('[["a", 1]]', "counts: expected a list of per-layer lists of numbers"),
    ("[[1, -1, 2, 3, 4, 5, 6, 7]]", "counts: every count must be a finite number >= 0"),
    ("[[1, .nan, 2, 3, 4, 5, 6, 7]]", "counts: every count must be a finite number >= 0"),
])
def test_a_bad_routing_histogram_is_one_line(tmp_path, capsys, counts, message):
    histogram = tmp_path / "hist.yaml"
    histogram.write_text(f"counts: {counts}\n")
    plan = _text_plan(tmp_path, "tokens: 1.0e6", "tokens: 1.0e6\nexpert_transport: {routing: histogram, "
                                                 f"histogram: {histogram}}}")
    assert message in _refused(capsys, "estimate", plan)


def test_placement_groups_are_closed_form_equal_to_enumerating_the_members():
    """simulator.placement.make_group counted the members one by one (minutes for a 2^24-rank data group); the
    closed form must give the same domains and members per domain."""
    import random

    from rackcast.simulator.placement import make_group

    rng = random.Random(18)
    for _ in range(20_000):
        size, stride, usable = rng.randint(1, 200), rng.randint(1, 200), rng.randint(1, 200)
        members = [k * stride for k in range(size)]
        domains = sorted({r // usable for r in members})
        group = make_group(size, stride, usable)
        assert (group.domains, group.per_domain) == (len(domains), sum(r // usable == domains[0] for r in members))
    huge = make_group(2**24, 1, 64)
    assert (huge.domains, huge.per_domain, huge.span) == (2**18, 64, "scale_out")


def test_dualpipev_with_fewer_micro_batches_than_model_chunks_is_refused_at_load_naming_batch(tmp_path, capsys):
    # pipeline 2, virtual 2 (4 model chunks), global batch 8 over fsdp 2 in micro-batches of 2: 2 micro-batches
    text = ("name: dpv\nmodel: tiny-moe\ntopology: {name: local-cpu, domains: 1, usable_gpus: 4}\n"
            "parallel: {fsdp: 2, pipeline: 2, virtual: 2}\nbatch: {global_batch: 8, micro_batch: 2}\n"
            "schedule: dualpipev\n")
    path = tmp_path / "dpv.yaml"
    path.write_text(text)
    for args in (("estimate", str(path)), ("train", str(path), "--check")):
        line = _refused(capsys, *args)
        assert "batch: 2 micro-batches per step are fewer than the 4 model chunks" in line and "dpv.yaml" in line
