"""ModelSpec features the trainer does not build yet, named by their spec field.

The accounting, the estimate and the simulator price every ModelSpec feature; the PyTorch model (backend.model)
builds a subset. `rackcast train` refuses a model that asks for one outside it (backend.parallel.validate_trainable)
rather than silently training a different architecture. Features the trainer builds through the spec's own
queries need no entry here: dense-first layers (ModelSpec.is_moe) and per-layer attention patterns
(ModelSpec.is_global / context).
"""

from __future__ import annotations

from rackcast.modelspec import ModelSpec


def unbuilt_features(spec: ModelSpec) -> list[tuple[str, str]]:
    """(model field, what is missing) for each feature of `spec` the trainer cannot build."""
    a, m = spec.attention, spec.moe
    missing = []
    if a.mla is not None:
        missing.append(("attention.mla", "multi-head latent attention is not built by the trainer yet"))
    if a.sinks:
        missing.append(("attention.sinks", "attention sinks are not built by the trainer yet"))
    if spec.qk_norm:
        missing.append(("qk_norm", "query/key norms are not built by the trainer yet"))
    if spec.mtp is not None:
        missing.append(("mtp", "multi-token prediction is not built by the trainer yet"))
    if m is not None and m.node_limit:
        missing.append(("moe.node_limit", "node-limited routing is not built by the trainer yet"))
    # The trainer balances a router with a bias by quantile balancing, and a router without one not at all.
    if m is not None and m.balance_method != ("quantile" if m.router_bias else "none"):
        missing.append(("moe.balancing", f"the trainer balances a {'biased' if m.router_bias else 'bias-free'} "
                                         f"router by {'quantile balancing' if m.router_bias else 'nothing'}, "
                                         f"not {m.balance_method}"))
    return missing
