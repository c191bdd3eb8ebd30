"""Op counts of the backend model for the host per-op overhead (simulator.host_overhead), without importing torch.

`op_counts(spec, optimizer)` returns backend.opcount.count_ops's dict (framework ops per micro-batch by where they
run, backward/forward ratio, optimizer ops). Op counts depend on the model's structure, not on its widths, so they
are counted on the spec's structural twin (`structural_twin`: the same layers, attention pattern, experts, shared
experts and features, every width shrunk to a few units while keeping the branches the backend takes): under a
second for marin-ladder-d768, about 10 s for marin-535b-a23b (its 48 layers x 384 experts' loop), where building
the full model on a CPU takes minutes or runs out of memory. The result is cached: per process in memory, and on
disk as one JSON file per key under $RACKCAST_CACHE/op-counts/ (else ~/.cache/rackcast/op-counts/). The key is a
hash of the twin's data (rackcast.strict.to_data, less name, family and description), the optimizer and the
installed torch version (read from the package metadata, no import): models of one structure share one count
whatever their widths, while another structure, optimizer or torch counts again. A miss runs
`python -m rackcast.backend.opcount - --optimizer X` in a subprocess with the twin as JSON on its stdin and writes the cache
file atomically. A failure is one RackcastError line. The returned dict names the model asked for ("model").

Why a twin counts the same (see backend.model, layers, attention, moe, optim): an op count changes with a width only
where the code branches on it. Those branches are kept: the rotary split of a head (nothing, part or all of it
rotated), the window against the counted tokens (masked or causal attention), the short convolution's lags against
them, and the orientation of every matrix in the optimizer step (Newton-Schulz transposes a tall matrix), which is
why the two sides of every matrix keep their order (d_model against each width it projects to or from, the experts'
input width against their hidden width); no width becomes 1 (a size-1 dimension can change strides and so a
reshape's ops). Head and KV-head counts are kept, not shrunk. Routing is made to reach every expert
(backend.opcount), so the routed weights' values do not matter either. tests/test_op_counts.py checks the twin's
counts against full counts.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import fields, replace
from importlib import metadata
from pathlib import Path

from rackcast.errors import RackcastError
from rackcast.modelspec import ModelSpec
from rackcast.strict import to_data, write_text_atomic

ROOT = Path(__file__).resolve().parent.parent
CACHE_ENV = "RACKCAST_CACHE"
CACHE_SUBDIR = "op-counts"
KEYS = ("fwd_embed", "fwd_layers", "fwd_experts", "fwd_head", "bwd_over_fwd", "optimizer_ops")
UNKEYED = ("name", "family", "description")  # labels, not structure: left out of the cache key
COUNT_SEQ = 32  # tokens per counted sequence (backend.opcount): more than any preset's conv kernel, so every lag runs
GROUPED_MM_ALIGN_BYTES = 16  # torch grouped_mm wants row strides of a multiple of 16 bytes (backend.moe pads others)
COUNT_DTYPE_BYTES = 4  # counts run in fp32 (backend.opcount)
MIN_WIDTH = 2  # a dimension of 1 can change which strides torch sees as contiguous (and so a reshape's or a
# matmul's ops); 2 behaves like any larger size, so a twin width is 1 only where the full spec's is
_MEMORY: dict[str, dict] = {}  # key -> counts, this process


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    base = Path(root) if root else Path.home() / ".cache" / "rackcast"
    return base / CACHE_SUBDIR


def spec_data(spec: ModelSpec) -> dict:
    """The spec's plain data over ModelSpec's own fields (a planner subclass such as FastSpec counts the same)."""
    return {f.name: to_data(getattr(spec, f.name)) for f in fields(ModelSpec) if f.init}


# ---------------------------------------------------------------------------------------------------- the twin
def rotary_dims(head_dim: int, fraction: float) -> int:
    """backend.layers.rotary_dims (rotated dims per head), restated so this module does not import torch."""
    return int(head_dim * fraction) // 2 * 2


def _rope_kind(head_dim: int, fraction: float) -> tuple[bool, bool]:
    """The branches of backend.layers.apply_rope a head width takes: nothing rotated; everything rotated."""
    rot = rotary_dims(head_dim, fraction)
    return rot == 0, rot == head_dim


def _head_multiples(spec: ModelSpec) -> dict[str, int]:
    """Widths that are multiples of head_dim, by name: the multiple (query width; stored K/V width per count)."""
    out = {"q": spec.attention.heads}
    for i in range(spec.layers):
        out[f"kv{spec.kv_heads_stored(i)}"] = spec.kv_heads_stored(i)
    return out


def widths(spec: ModelSpec) -> dict[str, int]:
    """Every width of the spec by name, off features (0) left out."""
    out = {k: v * spec.attention.head_dim for k, v in _head_multiples(spec).items()}
    out.update(head_dim=spec.attention.head_dim, d_model=spec.d_model, vocab=spec.vocab, ffn=spec.ffn,
               gated_norm_rank=spec.gated_norm_rank)
    if spec.moe is not None:
        out.update(expert_ffn=spec.moe.expert_ffn, latent_dim=spec.moe.latent_dim, shared_ffn=spec.moe.shared_ffn)
    return {k: v for k, v in out.items() if v > 0}


def paired_widths(spec: ModelSpec) -> list[tuple[str, str]]:
    """The pairs of widths that are the two sides of one matrix: d_model against every width it projects to or
    from, and the routed experts' input width (the latent width, else d_model) against their hidden width."""
    w = widths(spec)
    pairs = [("d_model", k) for k in w if k not in ("d_model", "head_dim", "expert_ffn")]
    if "expert_ffn" in w:
        pairs.append(("latent_dim" if "latent_dim" in w else "d_model", "expert_ffn"))
    return pairs


def _between(below: list[int], above: list[int]) -> int | None:
    """The smallest width (at least MIN_WIDTH) above every value of `below` and below every value of `above`."""
    t = max([MIN_WIDTH - 1, *below]) + 1
    return t if not above or t < min(above) else None


def _twin_widths(spec: ModelSpec, head_dim: int) -> dict[str, int] | None:
    """Twin widths by name for the twin head width `head_dim`, or None where they cannot keep the orders. Head
    multiples scale with head_dim; d_model takes the smallest value keeping its order against them; every other width
    the smallest keeping its order against its pair's side (paired_widths). A twin width lies between the full one
    and MIN_WIDTH (or the full one, where smaller)."""
    full, mult = widths(spec), _head_multiples(spec)
    twin = {k: m * head_dim for k, m in mult.items()} | {"head_dim": head_dim}
    d = spec.d_model
    same = {twin[k] for k in mult if full[k] == d}
    if same:
        twin["d_model"] = same.pop()  # one value: equal widths of one head_dim are one multiple
    else:
        twin["d_model"] = _between([twin[k] for k in mult if full[k] < d], [twin[k] for k in mult if full[k] > d])
        if twin["d_model"] is None:
            return None
    for side, k in paired_widths(spec):  # d_model comes first, so the latent width precedes the experts' hidden one
        if k in twin:
            continue
        v, ref, ref_twin = full[k], full[side], twin[side]
        twin[k] = ref_twin if v == ref else (ref_twin + 1 if v > ref else min(v, MIN_WIDTH, ref_twin - 1))
    return twin if all(min(v, MIN_WIDTH) <= twin[k] <= v for k, v in full.items()) else None


def structure(spec: ModelSpec, seq: int = COUNT_SEQ) -> tuple:
    """What the backend's op count of `spec` on min(seq, seq_len) tokens depends on beyond the spec's other fields:
    per layer (global, MoE, KV heads, stored KV heads, masked attention), the counted tokens, the rotary branches,
    which widths are 1, and the order of the two sides of every matrix (paired_widths)."""
    s = min(spec.seq_len, seq)
    layers = [(spec.is_global(i), spec.is_moe(i), spec.kv_heads(i), spec.kv_heads_stored(i), spec.context(i) < s)
              for i in range(spec.layers)]
    w = widths(spec)
    order = sorted((a, b, (w[a] > w[b]) - (w[a] < w[b])) for a, b in paired_widths(spec))
    ones = sorted(k for k, v in w.items() if v == 1)
    return layers, s, _rope_kind(spec.attention.head_dim, spec.attention.rope_fraction), ones, order


def structural_twin(spec: ModelSpec, seq: int = COUNT_SEQ) -> ModelSpec:
    """A valid ModelSpec with `spec`'s structure and widths of a few units, whose backend model makes the same
    framework ops as `spec`'s when counted on min(seq, seq_len) tokens (backend.opcount.count_ops).

    Kept: layers, heads and KV-head counts, window or not, global_every, output gate, exclusive attention, rope
    fraction and placement, qk multiplier, biases, positional kind, experts, top_k, shared experts, dense layers,
    router bias, latent or not, activation, norms, gated norm or not, conv sites and kernel, tied embeddings.
    Shrunk: head_dim to the smallest keeping its rotary branches; every other width by `_twin_widths`, keeping the
    order of the two sides of each matrix (an optimizer step transposes a tall one: backend.optim.newton_schulz);
    seq_len to the counted tokens and the window to at most that (a local layer masks exactly when the full spec's
    does on those tokens). Idempotent, and the same for two specs whose widths differ but keep those orders."""
    a = spec.attention
    kind = _rope_kind(a.head_dim, a.rope_fraction)
    head_dim, w = a.head_dim, widths(spec)  # the spec's own widths, where no smaller ones keep the orders
    for candidate in range(min(a.head_dim, MIN_WIDTH), a.head_dim):
        found = _twin_widths(spec, candidate) if _rope_kind(candidate, a.rope_fraction) == kind else None
        if found is not None:
            head_dim, w = candidate, found
            break
    w = _keep_expert_alignment(spec, w)
    seq_len = min(spec.seq_len, seq)
    try:
        moe = spec.moe and replace(spec.moe, expert_ffn=w["expert_ffn"], latent_dim=w.get("latent_dim", 0),
                                   shared_ffn=w.get("shared_ffn", 0))
        twin = replace(spec, d_model=w["d_model"], vocab=w["vocab"], seq_len=seq_len, ffn=w.get("ffn", 0),
                       gated_norm_rank=w.get("gated_norm_rank", 0), moe=moe,
                       attention=replace(a, head_dim=head_dim, window=min(a.window, seq_len)))
    except (ValueError, TypeError) as exc:  # ModelSpec's own validation
        raise RackcastError(f"the structural twin of model {spec.name!r} is not a valid spec: {exc}") from None
    if structure(twin, seq) != structure(spec, seq):
        raise RackcastError(f"the structural twin of model {spec.name!r} lost part of its structure")
    return twin


def _keep_expert_alignment(spec: ModelSpec, twin: dict[str, int]) -> dict[str, int]:
    """Round the twin's routed-expert widths (expert_ffn and the experts' input, the latent width else d_model) up
    to grouped_mm's row alignment where the full spec's are aligned, so the twin takes the backend's unpadded
    grouped GEMMs as the full model does; unchanged where that would break the orders of paired widths."""
    if spec.moe is None:
        return twin
    unit = GROUPED_MM_ALIGN_BYTES // COUNT_DTYPE_BYTES
    full = widths(spec)
    inp = "latent_dim" if "latent_dim" in full else "d_model"
    if full[inp] % unit or full["expert_ffn"] % unit:
        return twin
    out = dict(twin)
    out[inp] = -(-twin[inp] // unit) * unit
    order = (full["expert_ffn"] > full[inp]) - (full["expert_ffn"] < full[inp])  # expert_ffn against its input
    out["expert_ffn"] = out[inp] + order * unit
    kept = all(0 < out[k] <= full[k] for k in out) and all(
        (full[a] > full[b]) - (full[a] < full[b]) == (out[a] > out[b]) - (out[a] < out[b])
        for a, b in paired_widths(spec))
    return out if kept else twin


# ---------------------------------------------------------------------------------------------------- the cache
def torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        raise RackcastError("the host per-op overhead (efficiency.host_op_s measured) needs op counts of the backend "
                            "model, which need torch installed; set efficiency.host_op_s to zeros to leave the term out") from None


def cache_key(spec: ModelSpec, optimizer: str) -> str:
    """Hash of the structural twin's data (labels left out), the optimizer and the torch version."""
    data = {k: v for k, v in spec_data(structural_twin(spec)).items() if k not in UNKEYED}
    text = json.dumps({"spec": data, "optimizer": optimizer, "torch": torch_version()}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _valid(counts) -> bool:
    return isinstance(counts, dict) and all(k in counts for k in KEYS)


def _count(spec: ModelSpec, optimizer: str) -> dict:
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-m", "rackcast.backend.opcount", "-", "--optimizer", optimizer], cwd=ROOT,
                          input=json.dumps(spec_data(structural_twin(spec))), capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise RackcastError(f"counting the ops of model {spec.name!r} (python -m rackcast.backend.opcount) failed: {why}")
    try:
        counts = json.loads(lines[-1])
    except json.JSONDecodeError:
        counts = None
    if not _valid(counts):
        raise RackcastError(f"counting the ops of model {spec.name!r} (python -m rackcast.backend.opcount) printed no counts")
    return counts


def op_counts(spec: ModelSpec, optimizer: str) -> dict:
    """backend.opcount's counts for `spec` trained with `optimizer` (see the module docstring)."""
    key = cache_key(spec, optimizer)
    counts = _MEMORY.get(key)
    path = cache_dir() / f"{key}.json"
    if counts is None and path.exists():
        try:
            counts = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            counts = None  # unreadable: count again and overwrite it
        if not _valid(counts):
            counts = None
    if counts is None:
        counts = _count(spec, optimizer)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(path, json.dumps(counts, sort_keys=True) + "\n")
        except OSError:  # a read-only cache or a concurrent writer: the counts stand, the next process recounts
            pass
    _MEMORY[key] = counts
    return {**counts, "model": spec.name}  # a count shared by models of one structure names the one asked for
