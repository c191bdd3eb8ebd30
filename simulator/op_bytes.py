"""Eager bytes of the backend model, as data, for the eager memory-traffic term (simulator.host_overhead); no torch,
no backend import.

An eager framework (the CPU trainer: PyTorch without compilation) runs every op as its own kernel, which reads its
inputs and writes its outputs whole. backend.opcount.count_bytes counts those bytes for every op that is not a
matrix product or an attention core (priced by FLOPs), by where it runs (embedding, each layer, head and loss),
for the backward and for one optimizer step, on the model as given at its seq_len, as [fixed, per_sequence] pairs:
bytes(b sequences) = fixed + b x per_sequence. Unlike op counts (simulator.op_counts, counted on a structural twin),
bytes depend on every width and on seq_len, so the key (`cache_key`) hashes the whole spec (labels left out) and the
optimizer.

Where the bytes are read from, first found wins: this process's memory; the op-byte cache, one JSON file per key
under $RACKCAST_CACHE/op-bytes/ (else ~/.cache/rackcast/op-bytes/), filled by `rackcast calibrate --op-counts MODEL`
(backend.opcount.count_into_cache); simulator/op_bytes.json, committed with the package for
simulator.op_counts.TABLE_MODELS (`rackcast calibrate --op-counts-table`; tests/test_op_bytes.py checks it against a
fresh count). Only models of at most MAX_PARAMS parameters are counted (`countable`); for any other, or one not
counted yet, `lookup` returns None and the cost model keeps its analytic (fused) elementwise term: the estimate's
`eager_bytes_counted` feature and `rackcast estimate`/`validate` say which term was used. The bytes are counted one
way (fp32 without autocast, SDPA's default kernel), so the key holds no plan field: simulator.host_overhead
.counted_bytes uses them only for plans that run that way (COUNTED_AS), the fused term for any other.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from rackcast.errors import RackcastError
from rackcast.modelspec import ModelSpec
from rackcast.simulator.op_counts import (UNKEYED, cache_dir, read_cached, read_table, spec_data, write_cached,
                                          write_section)

TABLE_PATH = Path(__file__).with_name("op_bytes.json")
CACHE_SUBDIR = "op-bytes"
KEYS = ("seq_len", "fwd_embed", "fwd_layers", "fwd_head", "bwd", "opt_step")
# The counter instantiates the model in fp32 with its gradients and optimizer state (about 16 bytes a parameter)
# and runs three sequences through it: 50M parameters is under 1 GB, seconds on a CPU. The tiny presets are ~1M.
MAX_PARAMS = 50_000_000
_MEMORY: dict[str, dict] = {}


def countable(spec: ModelSpec) -> bool:
    """Whether the byte counter instantiates this model (at most MAX_PARAMS parameters)."""
    return spec.params_total <= MAX_PARAMS


def check_countable(spec: ModelSpec) -> None:
    if not countable(spec):
        raise RackcastError(f"eager bytes of model {spec.name!r}: {spec.params_total:.3g} parameters, over the "
                            f"{MAX_PARAMS:.3g} the byte counter instantiates on a CPU; the analytic elementwise term "
                            "stands for it")


def cache_key(spec: ModelSpec, optimizer: str) -> str:
    """Hash of the spec's data (labels left out: widths and seq_len included) and the optimizer."""
    data = {k: v for k, v in spec_data(spec).items() if k not in UNKEYED}
    text = json.dumps({"spec": data, "optimizer": optimizer, "what": "bytes"}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _table(path: Path = TABLE_PATH) -> dict[str, dict]:
    """The packaged table's bytes by key."""
    return read_table(path, "bytes", KEYS)


def _cache_file(key: str) -> Path:
    return cache_dir().parent / CACHE_SUBDIR / f"{key}.json"


def lookup(spec: ModelSpec, optimizer: str) -> dict | None:
    """The eager bytes of `spec` trained with `optimizer` (memory, then cache, then table), or None: not counted."""
    key = cache_key(spec, optimizer)
    counts = _MEMORY.get(key) or read_cached(_cache_file(key), KEYS) or _table().get(key)
    if counts is not None:
        _MEMORY[key] = counts
    return counts


def store(spec: ModelSpec, optimizer: str, counts: dict) -> Path:
    """Write bytes the backend counted for `spec` into the op-byte cache (atomically); returns the file."""
    key = cache_key(spec, optimizer)
    path = write_cached(_cache_file(key), counts, KEYS, f"eager bytes of model {spec.name!r}")
    _MEMORY[key] = counts
    return path


def write_table(entries: dict[str, dict], torch_version: str, path: Path = TABLE_PATH) -> None:
    """Write the packaged table: bytes by key (cache_key), counted with `torch_version`."""
    write_section(entries, torch_version, path, "bytes", KEYS, "eager bytes")
