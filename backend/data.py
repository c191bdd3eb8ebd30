"""Training data present on every machine: the Python installation's own source and documentation, byte-tokenised.

Text: every *.py, *.txt and *.rst file under `sysconfig.get_paths()["stdlib"]` (site-packages and caches skipped),
then the repository's own *.md files, in sorted path order, capped at `max_bytes`. Each file's bytes are its tokens
(vocab 256, the tiny presets' vocabulary), files separated by a 0 byte. A file goes to the held-out split when
crc32(its relative path) % EVAL_EVERY == 0, so no file is in both splits.

Storage: uint8 token shards `train-00000.npy`, ... and `eval-00000.npy` under `<data_dir>/<key>/` with a manifest
written last (the key hashes the file list, so a different Python or cap builds its own cache). Built once, then
memory-mapped.

Sampling: the train split is cut into non-overlapping sequences of seq_len tokens; epoch e visits them in the order
of a permutation seeded by (seed, e). Optimizer step s takes stream positions [s*G, (s+1)*G) (G = global batch) and
data-parallel rank r of D takes positions r, r+D, r+2D, ... of those, so ranks never overlap and the union of all
ranks is exactly what one process with the same global batch sees.

    folder = prepare("runs/.data")      # build (or find) the cache; `rackcast train` calls it
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np

from rackcast.atomic import atomic_path, write_json_atomic

EVAL_EVERY = 50  # about 2% of files are held out
SHARD_TOKENS = 1 << 22
DEFAULT_MAX_BYTES = 24 << 20
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", ".git", ".venv", "node_modules"}
REPO = Path(__file__).resolve().parent.parent


def text_files(max_bytes: int = DEFAULT_MAX_BYTES) -> list[tuple[str, Path]]:
    """(label, path) of the text files used, in a fixed order, up to max_bytes in total."""
    found: list[tuple[str, Path]] = []
    for label, root, suffixes in (("stdlib", Path(sysconfig.get_paths()["stdlib"]), (".py", ".txt", ".rst")),
                                  ("repo", REPO, (".md",))):
        for d, dirs, files in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("."))
            for f in sorted(files):
                if f.endswith(suffixes):
                    p = Path(d) / f
                    found.append((f"{label}/{p.relative_to(root).as_posix()}", p))
    out, total = [], 0
    for label, p in found:
        size = p.stat().st_size
        if total + size > max_bytes:
            continue
        out.append((label, p))
        total += size
    return out


def prepare(data_dir: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> Path:
    """Build the token shards if they are not cached yet; return the cache folder (holding manifest.json)."""
    files = text_files(max_bytes)
    key_src = json.dumps([(label, p.stat().st_size) for label, p in files]).encode()
    key = hashlib.sha256(key_src).hexdigest()[:16]
    folder = Path(data_dir) / f"bytes-{key}"
    if (folder / "manifest.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[bytes]] = {"train": [], "eval": []}
    for label, p in files:
        split = "eval" if zlib.crc32(label.encode()) % EVAL_EVERY == 0 else "train"
        splits[split].append(p.read_bytes() + b"\0")
    manifest = {"tokenizer": "bytes", "vocab": 256, "files": len(files), "key": key, "shards": {}}
    for split, chunks in splits.items():
        tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8)
        names = []
        for i, start in enumerate(range(0, max(len(tokens), 1), SHARD_TOKENS)):
            name = f"{split}-{i:05d}.npy"
            with atomic_path(folder / name) as tmp, open(tmp, "wb") as fh:
                np.save(fh, tokens[start:start + SHARD_TOKENS].copy())
            names.append(name)
        manifest["shards"][split] = {"files": names, "tokens": int(len(tokens))}
    # written last: its presence means the cache is complete
    write_json_atomic(folder / "manifest.json", manifest, indent=1)
    return folder


class TokenData:
    """Sequences of one split, sampled as the module docstring describes."""

    def __init__(self, folder: str | Path, split: str, seq_len: int, seed: int = 0):
        folder = Path(folder)
        manifest = json.loads((folder / "manifest.json").read_text())
        shards = [np.load(folder / name, mmap_mode="r") for name in manifest["shards"][split]["files"]]
        self.tokens = np.concatenate(shards) if len(shards) > 1 else np.asarray(shards[0])
        self.seq_len, self.seed = seq_len, seed
        self.num_sequences = len(self.tokens) // seq_len
        if self.num_sequences == 0:
            raise ValueError(f"split {split} has {len(self.tokens)} tokens, fewer than one sequence of {seq_len}")
        self._perm_cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            self._perm_cache = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)}
        return self._perm_cache[epoch]

    def sequence(self, position: int) -> np.ndarray:
        """The sequence at a position of the shuffled stream (epochs follow each other)."""
        epoch, i = divmod(position, self.num_sequences)
        j = int(self._perm(epoch)[i])
        return self.tokens[j * self.seq_len:(j + 1) * self.seq_len]

    def batch(self, step: int, global_batch: int, rank: int = 0, ranks: int = 1) -> np.ndarray:
        """[global_batch / ranks, seq_len] int64 tokens of `rank` for optimizer step `step`: the rank's contiguous
        share of the step's sequences, so its micro-batches are those one process would form (a per-micro-batch
        statistic, such as the auxiliary balancing loss's f and P, is then the same under any data-parallel degree)."""
        share = global_batch // ranks
        first = step * global_batch + rank * share
        positions = range(first, first + share)
        return np.stack([self.sequence(p) for p in positions]).astype(np.int64)

    def eval_batch(self, count: int, rank: int = 0, ranks: int = 1) -> np.ndarray:
        """A fixed held-out batch (the first `count` sequences of the unshuffled split), this rank's share."""
        count = min(count, self.num_sequences)
        rows = [self.tokens[j * self.seq_len:(j + 1) * self.seq_len] for j in range(rank, count, ranks)]
        return np.stack(rows).astype(np.int64)
