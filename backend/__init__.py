"""rackcast's PyTorch backend: the model, optimizers, balancing and trainer built from a ModelSpec.

Only this package imports torch (design.md, Conventions), so importing it is deliberately lazy: pull the pieces from
their modules, e.g. `from backend.model import build_model` and `from backend.optim import build_optimizer`.

    .venv/bin/pytest -q tests/test_backend_model.py tests/test_backend_optim.py
"""
