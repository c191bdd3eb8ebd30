"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, atomic, and resumable on another layout.

What is saved, under global names that do not depend on the layout (a run saved under DP2 x EP2 resumes under EP4,
a pipeline, or one process; `resume_problem` only refuses another model, optimizer, global batch or seed):
- model.<fqn>: every parameter and buffer under the full model's names (a rank holding pipeline chunks saves theirs,
  `global_view` merges them); expert stacks as the full [experts, ...] tensor, each expert-parallel rank's slice
  saved as its shard (`shard_of`: a DTensor over the expert-data x expert mesh, Replicate x Shard(0)); the
  quantile-balancing state is the router bias, a parameter (its margins live within one step only);
- optim.state.<fqn>.<key> and optim.param_groups.<fqn>.<key>: the optimizer's state per parameter (MuonH momentum,
  Adam moments and step counts), through torch.distributed.checkpoint.state_dict.get_state_dict with the flattened
  optimizer layout, sharded like the parameter it belongs to;
- trainer.step (the data position: batches are a function of the step, backend.data), trainer.rows (the metric
  rows so far, from rank 0), trainer.routing (tokens routed per layer and expert, summed over ranks) and
  trainer.rng.<rank> (each rank's torch RNG state; a rank the saving run did not have takes rank 0's).
Parameters that are already DTensors (FSDP2, tensor parallelism) are saved as they are: DCP reshards them itself.

Completion: every rank writes its DCP files into checkpoints/.tmp-step-NNNNNNNN/, then (after a barrier, or for an
asynchronous save once DCP reports the write done) rank 0 writes complete.json there and renames the folder to
step-NNNNNNNN. A folder without complete.json (a rank died while saving, or the launcher was killed) is never
resumed from and is removed by the next save. Rank 0 keeps the KEEP newest complete checkpoints. The folder must be
on storage every node sees.

    saver = Saver(run_dir, asynchronous=False)
    saver.save(step, model, optimizer, extra, info, shard_of)      # collective
    load(folder, model, optimizer, extra, shard_of)                # collective; returns the trainer.* values
    latest_complete(run_dir), resume_problem(folder, plan), full_model_state(folder)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

KEEP = 3  # complete checkpoints kept; older ones are removed by rank 0
MARKER = "complete.json"
STEP_PATTERN = re.compile(r"step-\d{8}")
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # per-parameter keys: reshardable optimizer state

# fqn -> (device mesh, placements) of this rank's plain local tensor inside the global one, or None (the tensor is
# the whole global tensor, or already a DTensor)
ShardOf = Callable[[str], "tuple[object, list] | None"]


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}"


def _temp_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f".tmp-step-{step:08d}"


def complete_steps(run_dir: str | Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if STEP_PATTERN.fullmatch(p.name) and (p / MARKER).exists())


def latest_complete(run_dir: str | Path) -> Path | None:
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


def written_by_old_version(run_dir: str | Path) -> bool:
    """True when the run folder holds checkpoints in the per-rank format of rackcast before DCP (not readable)."""
    root = Path(run_dir) / "checkpoints"
    return root.is_dir() and any((p / "manifest.json").exists() for p in root.glob("step-*"))


# ------------------------------------------------------------------------------------------------ identity
def identity(plan) -> dict:
    """What a checkpoint's continuation must share with it; the parallel layout and the topology may change."""
    from rackcast.plan import model_hash
    from rackcast.strict import to_data

    return {"model": model_hash(plan.model_spec()), "optimizer": to_data(plan.optimizer),
            "global_batch": plan.batch.global_batch, "seed": plan.seed}


def resume_problem(folder: Path, plan) -> str | None:
    """Why `plan` cannot continue the checkpoint in `folder` (one phrase), or None when it can."""
    saved = json.loads((folder / MARKER).read_text()).get("identity", {})
    differ = [key for key, value in identity(plan).items() if saved.get(key) != value]
    if differ:
        return f"was written by a plan with another {', '.join(differ).replace('_', ' ')}"
    return None


# ------------------------------------------------------------------------------------------------ state
def global_view(chunks: list[nn.Module]) -> nn.Module:
    """One module holding this rank's pipeline chunks under the full model's names: their children merged (layer
    dicts united), so parameter names are `embed.*`, `layers.<i>.*`, `head.*` whatever the layout."""
    view = nn.Module()
    for chunk in chunks:
        for name, child in chunk.named_children():
            if isinstance(child, nn.ModuleDict) and isinstance(getattr(view, name, None), nn.ModuleDict):
                getattr(view, name).update(child)
            elif isinstance(child, nn.ModuleDict):
                view.add_module(name, nn.ModuleDict(dict(child.items())))
            else:
                view.add_module(name, child)
    return view


def _optim_fqn(key: str) -> str:
    """The parameter name inside a flattened optimizer key `state.<fqn>.<state key>`."""
    return key[len("state."):].rpartition(".")[0]


def _globalise(state: dict, shard_of: ShardOf | None) -> dict:
    """Wrap each plain local shard as a DTensor of its global tensor, so DCP records where it sits."""
    if shard_of is None:
        return state
    from torch.distributed.tensor import DTensor

    def wrap(value, fqn):
        # A 0-d state (Adam's step count) is the same on every rank: it stays a plain (replicated) tensor.
        where = shard_of(fqn) if isinstance(value, torch.Tensor) and value.dim() and not isinstance(value, DTensor) \
            else None
        return DTensor.from_local(value, where[0], where[1], run_check=False) if where else value

    model = {k: wrap(v, k) for k, v in state["model"].items()}
    optim = {k: wrap(v, _optim_fqn(k)) if k.startswith("state.") else v for k, v in state["optim"].items()}
    return dict(state, model=model, optim=optim)


def _localise(values: dict) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in values.items()}


def _state(model: nn.Module, optimizer, shard_of: ShardOf | None) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
    return _globalise({"model": model_state, "optim": optim_state}, shard_of)


# ------------------------------------------------------------------------------------------------ save / load
@contextlib.contextmanager
def _quiet():
    """DCP warns that a process without a process group saves or loads alone: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
class Saver:
    """Writes a run's checkpoints (collective: every rank calls `save` at the same steps).

    Synchronous (default): `save` returns once the checkpoint is complete. Asynchronous: `save` copies the state
    into host memory and returns; a background thread writes it (dcp.async_save, over a gloo group of its own so
    its collectives never interleave with training's), and rank 0 marks it complete when DCP reports it written
    (its coordinator writes the metadata only after every rank's files are written): `poll` after each step,
    `wait` before the next save and at the end. benchmarks/bench_checkpoint.py measures the difference."""

    def __init__(self, run_dir: str | Path, asynchronous: bool = False):
        self.run_dir = Path(run_dir)
        self.asynchronous = asynchronous
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = dist.new_group(backend="gloo") if asynchronous and dist.is_initialized() else None
        self.pending = None  # (future, temporary folder, final folder, marker content)

    def save(self, step: int, model: nn.Module, optimizer, extra: dict, info: dict,
             shard_of: ShardOf | None = None, fail_hook=None) -> Path:
        """Write `model`, `optimizer` and `extra` (trainer.* values: step, rows, routing, rng.<rank>, as the trainer
        passes them) into a temporary folder; rank 0 then marks it complete with `info` (plan identity, layout) and
        renames it to step-NNNNNNNN.

        model: a module whose parameter names are the full model's (`global_view` of the pipeline chunks);
        optimizer: the optimizer over its parameters. Wrapped or sharded models (DDP, FSDP2, DTensor parameters)
        work as torch.distributed.checkpoint.state_dict.get_state_dict handles them; shard_of says where a plain
        tensor holding only part of a parameter (an expert-parallel slice) sits in the global one."""
        self.wait()
        tmp, final = _temp_dir(self.run_dir, step), step_dir(self.run_dir, step)
        if self.rank == 0:
            for stale in tmp.parent.glob(".tmp-step-*"):  # saves that a killed run left half-written
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        state = _state(model, optimizer, shard_of)
        state["trainer"] = extra
        marker = {"step": step, **info}
        with _quiet():
            if self.asynchronous:
                future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group,
                                        no_dist=not dist.is_initialized())
            else:
                dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        if fail_hook is not None:
            fail_hook("checkpoint")
        if self.asynchronous:
            self.pending = (future, tmp, final, marker)
            return final
        _barrier()  # every rank has written and is alive
        if self.rank == 0:
            _complete(tmp, final, marker, self.run_dir)
        _barrier()
        return final

    def poll(self) -> None:
        """Mark a finished asynchronous save complete (rank 0); nothing when none is pending or it still runs."""
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until the pending asynchronous save is written, then mark it complete (rank 0)."""
        if self.pending is None:
            return
        future, tmp, final, marker = self.pending
        self.pending = None
        future.result()
        if self.rank == 0:
            _complete(tmp, final, marker, self.run_dir)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _complete(tmp: Path, final: Path, marker: dict, run_dir: Path) -> None:
    """Rank 0: write the completion marker into the written folder, rename it into place, keep the KEEP newest."""
    staged = tmp / f".{MARKER}.tmp"
    staged.write_text(json.dumps(marker, indent=1))
    os.replace(staged, tmp / MARKER)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in complete_steps(run_dir)[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def load(folder: Path, model: nn.Module, optimizer, extra: dict, shard_of: ShardOf | None = None) -> dict:
    """Collective: fill `model` and `optimizer` from the checkpoint in `folder`, whatever layout wrote it, and
    return the trainer.* values named by `extra` (name -> a template value of the right type and shape; a name the
    checkpoint lacks is left out of the result)."""
    saved = saved_keys(folder)
    state = _state(model, optimizer, shard_of)
    state["trainer"] = {k: v for k, v in extra.items() if f"trainer.{k}" in saved}
    with _quiet():
        dcp.load(state, checkpoint_id=str(folder), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=_localise(state["model"]),
                   optim_state_dict=_localise(state["optim"]), options=OPTIONS)
    return state["trainer"]


def saved_keys(folder: Path) -> set[str]:
    return set(dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata)


def full_model_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's parameters and buffers from a complete checkpoint, read in this one process (no process
    group): expert stacks come back whole, whichever layout wrote them."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
             if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    with _quiet():
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return {k[len("model."):]: v for k, v in state.items()}
