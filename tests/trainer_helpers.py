"""The trainer tests' helpers live in rackcast.backend.tiny_runs (the benchmarks use them too); this name stays for
the tests that import it. `assert_trains_like` is the equivalence check the layout tests share."""

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
