"""Op counts of the backend model, as data, for the host per-op overhead (simulator.host_overhead); no torch, no
backend import, no subprocess.

`op_counts(spec, optimizer)` returns the counts backend.opcount.count_ops made (framework ops per micro-batch by where
they run, backward/forward ratio, optimizer ops, the expert-parallel dispatch path's own ops per MoE layer and capacity
mode's: DISPATCH_KEYS). Op counts depend on the model's structure, not on its widths, so
they are counted on the spec's structural twin (`structural_twin`: the same layers, attention pattern, experts,
shared experts and features, every width shrunk to a few units while keeping the branches the backend takes) and
stored under a key (`cache_key`): a hash of the twin's data (rackcast.strict.to_data, less name, family and
description) and the optimizer. Models of one structure share one count whatever their widths.

Where the counts are read from, first found wins:
- this process's memory;
- the op-count cache, one JSON file per key under $RACKCAST_CACHE/op-counts/ (else ~/.cache/rackcast/op-counts/),
  which the backend's counter fills (backend.opcount.count_into_cache, run by the front end for models of the
  user's own);
- simulator/op_counts.json, committed with the package: the presets a measured (calibrated) machine trains,
  TABLE_MODELS, with both optimizers, counted by the backend (backend.opcount.write_count_table) with the torch the
  file names. tests/test_op_counts.py checks it against a fresh count, so a torch whose op mix differs fails that
  test until the table is regenerated.
A structure in neither raises OpCountsMissing (a RackcastError naming the model and optimizer); the front ends say
how to count it. The returned dict names the model asked for ("model").

Why a twin counts the same (see backend.model, layers, attention, moe, optim): an op count changes with a width only
where the code branches on it. Those branches are kept: the rotary split of a head (nothing, part or all of it
rotated), the windowed attention's branches (banded or not, ragged last block: window_branches) at the model's own
seq_len, the short convolution's lags against
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
from dataclasses import fields, replace
from functools import lru_cache
from pathlib import Path

from rackcast.atomic import write_json_atomic, write_text_atomic
from rackcast.errors import RackcastError
from rackcast.modelspec import ModelSpec
from rackcast.strict import to_data

TABLE_PATH = Path(__file__).with_name("op_counts.json")
# The packaged table's models: the tiny presets that the examples, the tests and the validation suite train on a
# CPU, where the host overhead matters; a larger model on a measured topology is counted once into the cache.
TABLE_MODELS = ("tiny-dense", "tiny-moe", "tiny-moe-dense0")
CACHE_ENV = "RACKCAST_CACHE"
CACHE_SUBDIR = "op-counts"
# backend.opcount.count_ep_dispatch's: the expert-parallel dispatch path's own ops per MoE layer, capacity mode's
DISPATCH_KEYS = ("ep_fwd", "ep_bwd", "capacity_fwd", "capacity_bwd")
# backend.opcount's per step, outside the micro-batches: the step's end (the balancer's step, zero_grad), the
# gradient reduction's host ops (count_grad_reduction: DDP's, the flat expert and dense reductions'), whole model
STEP_KEYS = ("step_ops", "ddp_ops", "expert_reduce_ops", "dense_reduce_ops")
KEYS = ("fwd_embed", "fwd_layers", "fwd_experts", "fwd_head", "bwd_over_fwd", "optimizer_ops", *DISPATCH_KEYS,
        *STEP_KEYS)
UNKEYED = ("name", "family", "description", "recipe")  # labels and the recipe, not structure: not in the key
COUNT_SEQ = 32  # tokens per counted sequence (backend.opcount): more than any preset's conv kernel, so every lag runs
GROUPED_MM_ALIGN_BYTES = 16  # torch grouped_mm wants row strides of a multiple of 16 bytes (backend.moe pads others)
COUNT_DTYPE_BYTES = 4  # counts run in fp32 (backend.opcount)
WINDOW_CHUNKS = 4  # the backend's windowed attention takes queries in blocks of window / WINDOW_CHUNKS
MIN_WIDTH = 2  # a dimension of 1 can change which strides torch sees as contiguous (and so a reshape's or a
# matmul's ops); 2 behaves like any larger size, so a twin width is 1 only where the full spec's is
_MEMORY: dict[str, dict] = {}  # key -> counts, this process


class OpCountsMissing(RackcastError):
    """No op counts for this model's structure and optimizer, in the cache or the packaged table."""

    def __init__(self, model: str, optimizer: str):
        self.model, self.optimizer = model, optimizer
        super().__init__(f"no op counts for model {model!r} with optimizer {optimizer}: its structure is in "
                         f"neither {TABLE_PATH.name} nor the op-count cache ({cache_dir()}); the host per-op "
                         "overhead (a measured efficiency.host_op_s) needs the backend to count them once")

    def __reduce__(self):  # rebuilt from its fields when it crosses a process pool
        return OpCountsMissing, (self.model, self.optimizer)


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    base = Path(root) if root else Path.home() / ".cache" / "rackcast"
    return base / CACHE_SUBDIR


def spec_data(spec: ModelSpec) -> dict:
    """The spec's plain data over ModelSpec's own fields (a subclass carrying derived fields counts the same)."""
    return {f.name: to_data(getattr(spec, f.name)) for f in fields(ModelSpec) if f.init}


# ---------------------------------------------------------------------------------------------------- the twin
def rotary_dims(head_dim: int, fraction: float) -> int:
    """backend.layers.rotary_dims (rotated dims per head), restated so this module does not import torch."""
    return int(head_dim * fraction) // 2 * 2


def window_query_block(window: int) -> int:
    """Queries per block of the backend's sliding-window attention (backend.attention.banded_attention): each
    query reads window + block - 1 keys, so a smaller block wastes fewer masked scores and a larger one makes
    fewer, larger kernel calls. Here (not in simulator.activations, which imports it) because the op count's
    twin keeps its branches (`window_branches`)."""
    return max(1, window // WINDOW_CHUNKS)


def window_branches(window: int, seq: int) -> tuple[bool, bool, bool]:
    """The branches backend.attention takes for a local layer of context `window` on `seq` tokens: banded (window
    < seq), and when banded a ragged last block (seq not a multiple of window_query_block: padded and cut) and
    one-query blocks (a size-1 dimension: views where larger blocks copy)."""
    if not window or window >= seq:
        return False, False, False
    block = window_query_block(window)
    return True, seq % block != 0, block == 1


def _twin_window(window: int, seq_len: int, twin_seq: int) -> int:
    """The twin's window on `twin_seq` tokens: the largest one, at most the full window, whose window_branches
    there are those of the full window on the model's own seq_len (what it trains on)."""
    if not window:
        return 0
    full = window_branches(window, seq_len)
    for w in range(min(window, twin_seq), 0, -1):
        if window_branches(w, twin_seq) == full:
            return w
    raise RackcastError(f"no window on {twin_seq} counted tokens takes the branches of window {window} on "
                        f"{seq_len}")


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
    """What the backend's op count of `spec` depends on beyond the spec's other fields: per layer (global, MoE, KV
    heads, stored KV heads, the windowed attention's branches on the spec's own seq_len: window_branches), the
    counted tokens min(seq, seq_len), the rotary branches, which widths are 1, and the order of the two sides of
    every matrix (paired_widths)."""
    s = min(spec.seq_len, seq)
    layers = [(spec.is_global(i), spec.is_moe(i), spec.kv_heads(i), spec.kv_heads_stored(i),
               window_branches(0 if spec.is_global(i) else spec.context(i), spec.seq_len))
              for i in range(spec.layers)]
    w = widths(spec)
    order = sorted((a, b, (w[a] > w[b]) - (w[a] < w[b])) for a, b in paired_widths(spec))
    ones = sorted(k for k, v in w.items() if v == 1)
    return layers, s, _rope_kind(spec.attention.head_dim, spec.attention.rope_fraction), ones, order


def structural_twin(spec: ModelSpec, seq: int = COUNT_SEQ) -> ModelSpec:
    """A valid ModelSpec with `spec`'s structure and widths of a few units, whose backend model makes the same
    framework ops as `spec`'s at its own seq_len, counted on min(seq, seq_len) tokens (backend.opcount.count_ops).

    Kept: layers, heads and KV-head counts, window or not, global_every, output gate, exclusive attention, rope
    fraction and placement, qk multiplier, biases, positional kind, experts, top_k, shared experts, dense layers,
    router bias, latent or not, activation, norms, gated norm or not, conv sites and kernel, tied embeddings.
    Shrunk: head_dim to the smallest keeping its rotary branches; every other width by `_twin_widths`, keeping the
    order of the two sides of each matrix (an optimizer step transposes a tall one: backend.optim.newton_schulz);
    seq_len to the counted tokens and the window to the largest that takes, on those tokens, the branches the full
    window takes on the full seq_len (_twin_window: banded or not, ragged last block or not). Idempotent, and the
    same for two specs whose widths differ but keep those orders."""
    a = spec.attention
    if a.mla is not None:
        # The twin shrinks head_dim and the widths it pairs; latent attention's ranks and head split are not among
        # them yet, so its op count (the host per-op overhead term) is refused rather than guessed.
        raise RackcastError(f"op counts of model {spec.name!r}: the host per-op overhead does not model latent "
                            "attention (attention.mla) yet; set efficiency.host_op_s to zeros to leave the term out")
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
                       attention=replace(a, head_dim=head_dim, window=_twin_window(a.window, spec.seq_len, seq_len)))
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


# ---------------------------------------------------------------------------------------------------- the data
def cache_key(spec: ModelSpec, optimizer: str) -> str:
    """Hash of the structural twin's data (labels left out) and the optimizer."""
    data = {k: v for k, v in spec_data(structural_twin(spec)).items() if k not in UNKEYED}
    text = json.dumps({"spec": data, "optimizer": optimizer}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def has_keys(counts, keys: tuple[str, ...]) -> bool:
    return isinstance(counts, dict) and all(k in counts for k in keys)


def valid(counts) -> bool:
    return has_keys(counts, KEYS)


@lru_cache(maxsize=None)
def read_table(path: Path, section: str, keys: tuple[str, ...]) -> dict[str, dict]:
    """A packaged table's entries under `section` that have `keys` (empty when the file is missing or unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {k: v for k, v in data.get(section, {}).items() if has_keys(v, keys)}


def _table(path: Path = TABLE_PATH) -> dict[str, dict]:
    """The packaged table's counts by key."""
    return read_table(path, "counts", KEYS)


def read_cached(path: Path, keys: tuple[str, ...]) -> dict | None:
    """A cache file's entry, or None where it is absent, unreadable or lacks `keys` (the table's, or a recount,
    stands)."""
    try:
        counts = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return counts if has_keys(counts, keys) else None


def _cached(key: str) -> dict | None:
    return read_cached(cache_dir() / f"{key}.json", KEYS)


def lookup(spec: ModelSpec, optimizer: str) -> dict | None:
    """The counts for `spec`'s structure and `optimizer` (memory, then cache, then table), or None."""
    key = cache_key(spec, optimizer)
    counts = _MEMORY.get(key) or _cached(key) or _table().get(key)
    if counts is not None:
        _MEMORY[key] = counts
    return counts


def op_counts(spec: ModelSpec, optimizer: str) -> dict:
    """The backend's counts for `spec` trained with `optimizer` (see the module docstring)."""
    counts = lookup(spec, optimizer)
    if counts is None:
        raise OpCountsMissing(spec.name, optimizer)
    return {**counts, "model": spec.name}  # a count shared by models of one structure names the one asked for


def write_cached(path: Path, counts: dict, keys: tuple[str, ...], what: str) -> Path:
    """Write one entry into a cache file (atomically), refusing one that lacks `keys`; returns the file."""
    if not has_keys(counts, keys):
        raise RackcastError(f"{what} lack {', '.join(k for k in keys if k not in counts)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, counts, indent=None, sort_keys=True)
    return path


def store(spec: ModelSpec, optimizer: str, counts: dict) -> Path:
    """Write counts the backend made for `spec`'s structure into the op-count cache (atomically); returns the file."""
    key = cache_key(spec, optimizer)
    path = write_cached(cache_dir() / f"{key}.json", counts, KEYS, f"op counts of model {spec.name!r}")
    _MEMORY[key] = counts
    return path


def write_section(entries: dict[str, dict], torch_version: str, path: Path, section: str, keys: tuple[str, ...],
                  what: str) -> None:
    """Write a packaged table: entries by key under `section`, counted with `torch_version`."""
    bad = [k for k, v in entries.items() if not has_keys(v, keys)]
    if bad:
        raise RackcastError(f"{what} under {', '.join(bad)} lack fields")
    rows = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(entries.items()))
    write_text_atomic(path, f'{{"torch": {json.dumps(torch_version)}, {json.dumps(section)}: {{\n{rows}\n}}}}\n')
    read_table.cache_clear()


def write_table(entries: dict[str, dict], torch_version: str, path: Path = TABLE_PATH) -> None:
    """Write the packaged table: counts by key (cache_key), counted with `torch_version`."""
    write_section(entries, torch_version, path, "counts", KEYS, "op counts")
