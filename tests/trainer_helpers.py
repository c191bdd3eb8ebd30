"""The trainer tests' helpers live in rackcast.backend.tiny_runs (the benchmarks use them too); this name stays for
the tests that import it. `assert_trains_like` is the equivalence check the layout tests share, `reference_run` the
one-process runs they compare against (once per session), `optimizer_cases` the layouts that also run with Adam, `inline_preset` a preset to vary as a plan's model."""

from rackcast.backend.tiny_runs import losses, manifest, routing, run_worker, write_plan  # noqa: F401


def assert_trains_like(run, ref_losses, ref_params) -> None:
    """The run in folder `run` reproduces the reference: losses to 1e-5 relative, and its last checkpoint's whole
    model parameters (any layout merged back) to 1e-5 absolute."""
    import pytest
    import torch

    from rackcast.backend.checkpoint import full_model_state, latest_complete

    assert losses(run) == pytest.approx(ref_losses, rel=1e-5)
    params = full_model_state(latest_complete(run))
    assert params.keys() == ref_params.keys()
    for key, value in ref_params.items():
        torch.testing.assert_close(params[key], value, atol=1e-5, rtol=0, msg=key)


def inline_preset(preset: str, name: str, drop: tuple = ()) -> dict:
    """A model preset as a plan's inline `model:` block, renamed, without its recipe and the `drop` fields; callers
    change fields of the dict it returns."""
    import yaml

    from rackcast.presets import MODEL_PRESET_DIR

    spec = yaml.safe_load((MODEL_PRESET_DIR / f"{preset}.yaml").read_text())
    for field in ("recipe", *drop):
        spec.pop(field, None)
    spec["name"] = name
    return spec


_REFERENCE_RUNS: dict = {}


def reference_run(tmp_path_factory, optimizer: str, steps: int, *args: str, **plan_fields):
    """The run folder of one process training write_plan's tiny plan with these fields, run once per test session:
    several layout test files compare against the same one-process run, so they share it (read-only)."""
    key = repr((optimizer, steps, args, sorted(plan_fields.items())))
    if key not in _REFERENCE_RUNS:
        d = tmp_path_factory.mktemp(f"ref-{optimizer}")
        done = run_worker(write_plan(d / "ref.yaml", {}, optimizer=optimizer, **plan_fields), d / "run", steps, *args)
        assert done.returncode == 0, done.stderr[-3000:]
        _REFERENCE_RUNS[key] = d / "run"
    return _REFERENCE_RUNS[key]


def optimizer_cases(layouts, adamw_too) -> list:
    """(optimizer, layout) test cases: every layout with MuonH (Adam on its 1-D and embedding groups), and with Adam
    on every group only the layouts in `adamw_too`: those that place optimizer state differently from a sibling
    (sharded, on the host, resumed) or reduce gradients a new way, where Adam's moments would show a misplaced or
    misscaled gradient that MuonH's orthogonalised update hides."""
    import pytest

    unknown = set(adamw_too) - set(layouts)
    assert not unknown, f"adamw_too names no layout: {sorted(unknown)}"
    return ([pytest.param("muonh", name, id=f"muonh-{name}") for name in layouts]
            + [pytest.param("adamw", name, id=f"adamw-{name}") for name in layouts if name in adamw_too])
