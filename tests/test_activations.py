"""The eager activation count (simulator.activations, activations="eager") against rackcast's own backend: the
bytes torch.autograd.graph.saved_tensors_hooks sees one backend layer, the embedding and the head with the loss save
(unique storages, new in that forward), and the peak live bytes the profiler measures over a whole forward and
backward (backend.memprof), for three structurally different presets: tiny-moe (every Marin feature), tiny-moe-dense0
(its first layer a dense SwiGLU MLP) and tiny-dense (GPT: LayerNorm, learned positions, GELU, biases, full MHA).

The tolerance is 5%; on torch 2.13 (CPU, fp32) the layer, embedding and head counts are exact to the byte but for
the nll_loss's 4-byte total weight, and the whole step's peak is within 0.1% (the rest: small temporaries of the
loss backward besides the three logits-sized ones the model counts).

    .venv/bin/pytest -q tests/test_activations.py
"""

from __future__ import annotations

import pytest
import torch

from rackcast.backend.memprof import live_cpu_tensors, profile_peak
from rackcast.backend.model import build_model, next_token_loss
from rackcast.plan import Plan
from rackcast.presets import load_model
from rackcast.strict import from_data
from rackcast.simulator.activations import (eager_loss_backward_bytes_per_token, edge_activation_bytes_per_token,
                                   layer_activation_bytes_per_token)

PRESETS = ["tiny-moe", "tiny-moe-dense0", "tiny-dense"]
TOLERANCE = 0.05


def _plan(model: str, micro_batch: int) -> Plan:
    return from_data(Plan, {"name": "t", "model": model, "topology": {"name": "local-cpu", "usable_gpus": 1},
                            "parallel": {}, "batch": {"global_batch": 2 * micro_batch, "micro_batch": micro_batch},
                            "optimizer": {"name": "muonh"}})


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def saved_bytes(fn, *inputs: torch.Tensor, counted: tuple[torch.Tensor, ...] = ()) -> int:
    """Bytes of the unique storages autograd saves while fn(*inputs) runs, leaving out storages that existed before
    (parameters, the RoPE and mask caches, anything passed in) except those of `counted`."""
    fn(*inputs)  # fill the caches (RoPE tables, window masks) first
    before = {_storage(t)[0] for t in live_cpu_tensors()} - {_storage(t)[0] for t in counted}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage(t)
        if ptr and ptr not in before:
            seen[ptr] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return sum(seen.values())


def _batch(spec, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec.vocab, (micro_batch, spec.seq_len), generator=g)
    targets = torch.full_like(tokens, -100)
    targets[:, :-1] = tokens[:, 1:]  # as backend.model.shifted_targets
    return tokens, targets


@pytest.mark.parametrize("micro_batch", [2, 4])
@pytest.mark.parametrize("preset", PRESETS)
def test_eager_layer_bytes_equal_what_autograd_saves_in_a_backend_layer(preset, micro_batch):
    spec = load_model(preset)
    plan, model = _plan(preset, micro_batch), build_model(spec, seed=0)
    tokens = micro_batch * spec.seq_len
    x = torch.randn(micro_batch, spec.seq_len, spec.d_model, requires_grad=True)
    for i, block in enumerate(model.layers):
        got = saved_bytes(block, x, counted=(x,)) / tokens  # the layer's input is its first norm's saved input
        eager = layer_activation_bytes_per_token(spec, i, plan, dtype="fp32", activations="eager")
        assert eager == pytest.approx(got, rel=TOLERANCE), (preset, i)
        assert layer_activation_bytes_per_token(spec, i, plan, dtype="fp32") < eager  # fused keeps less


@pytest.mark.parametrize("preset", PRESETS)
def test_eager_edge_bytes_equal_what_the_embedding_and_the_head_with_its_loss_save(preset):
    spec, micro_batch = load_model(preset), 2
    plan, model = _plan(preset, micro_batch), build_model(spec, seed=0)
    tokens, targets = _batch(spec, micro_batch)
    n = micro_batch * spec.seq_len
    # Token ids and targets are counted once per step (eager_step_bytes_per_token), not here.
    embed = saved_bytes(model.embed, tokens) / n
    assert edge_activation_bytes_per_token(spec, plan, first=True, last=False, dtype="fp32",
                                           activations="eager") == pytest.approx(embed, rel=TOLERANCE, abs=1.0)
    x = torch.randn(micro_batch, spec.seq_len, spec.d_model, requires_grad=True)
    head = saved_bytes(lambda h: next_token_loss(model.head(h), None, targets=targets), x, counted=(x,)) / n
    assert edge_activation_bytes_per_token(spec, plan, first=False, last=True, dtype="fp32",
                                           activations="eager") == pytest.approx(head, rel=TOLERANCE)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_backend_step_peaks_at_the_eager_activations_plus_the_loss_backward_temporaries(preset):
    """Forward, loss and backward of one micro-batch with the gradients already allocated (as on a later
    micro-batch): the profiler's peak over what existed before is the saved tensors plus the transient of the
    z-loss's logsumexp backward, at its start."""
    spec, micro_batch = load_model(preset), 4
    plan, model = _plan(preset, micro_batch), build_model(spec, seed=0)
    tokens, targets = _batch(spec, micro_batch)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)

    def step() -> None:
        loss, _ = next_token_loss(model(tokens), tokens, targets=targets)
        loss.backward()

    step()  # caches
    _, peak = profile_peak(step)
    per_token = sum(layer_activation_bytes_per_token(spec, i, plan, dtype="fp32", activations="eager")
                    for i in range(spec.layers))
    per_token += edge_activation_bytes_per_token(spec, plan, dtype="fp32", activations="eager")
    per_token += eager_loss_backward_bytes_per_token(spec)
    assert per_token * micro_batch * spec.seq_len == pytest.approx(peak.step_bytes, rel=TOLERANCE)
