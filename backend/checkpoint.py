"""Checkpoints: every rank saves its own shard atomically; a manifest written last by rank 0 makes one complete.

Layout: <run>/checkpoints/step-00000040/rank-00003.pt (model chunks' parameters under the full model's names, this
rank's expert slice, optimizer state, RNG state, the layout) and manifest.json. Each file is written atomically
(rackcast.atomic); after all ranks have saved, a barrier, then rank 0 writes manifest.json the same way. A step
folder without a manifest (a rank died while saving) is never resumed from. Rank 0's shard also carries the metric
rows so far, so a resumed run's metrics.parquet continues the same curve.

    latest_complete(run_dir)  -> step folder or None
    merge_full_state(folder)  -> {name: tensor} of the whole model (expert slices concatenated)
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from rackcast.atomic import atomic_path, write_json_atomic
from rackcast.backend.parallel import Layout, is_expert_param

KEEP = 3  # complete checkpoints kept; older ones are removed by rank 0


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


def complete_steps(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if re.fullmatch(r"step-\d{8}", p.name) and (p / "manifest.json").exists()]
    return sorted(found)


def latest_complete(run_dir: str | Path) -> Path | None:
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


def save(run_dir: str | Path, step: int, layout: Layout, model_state: dict, optimizer, extra: dict,
         plan_hash: str, fail_hook=None) -> Path:
    """Collective: every rank writes its shard, then rank 0 writes the manifest after a barrier."""
    folder = step_dir(run_dir, step)
    folder.mkdir(parents=True, exist_ok=True)
    shard = {"step": step, "layout": layout.__dict__, "model": model_state, "optimizer": optimizer.state_dict(),
             "rng": torch.get_rng_state(), **extra}
    with atomic_path(folder / f"rank-{layout.rank:05d}.pt") as tmp:
        torch.save(shard, tmp)
    if fail_hook is not None:
        fail_hook("checkpoint")
    if dist.is_initialized():
        dist.barrier()
    if layout.rank == 0:
        manifest = {"step": step, "world": layout.world, "plan_hash": plan_hash,
                    "files": sorted(p.name for p in folder.glob("rank-*.pt"))}
        write_json_atomic(folder / "manifest.json", manifest, indent=1)
        for old in complete_steps(run_dir)[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    return folder


def load(folder: Path, rank: int) -> dict:
    return torch.load(folder / f"rank-{rank:05d}.pt", map_location="cpu", weights_only=False)


def merge_full_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's parameters from a complete checkpoint: dense ones from each stage's first data-parallel
    rank, expert stacks concatenated over the expert-parallel ranks of the first expert-data replica."""
    folder = Path(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name in manifest["files"]:
        shard = torch.load(folder / name, map_location="cpu", weights_only=False)
        lay = shard["layout"]
        for key, value in shard["model"].items():
            if is_expert_param(key) and lay["ep"] > 1:
                if lay["edp_rank"] == 0:
                    pieces.setdefault(key, {})[lay["ep_rank"]] = value
            elif lay["dp_rank"] == 0:
                out[key] = value
    for key, parts in pieces.items():
        out[key] = torch.cat([parts[i] for i in sorted(parts)])
    return out
