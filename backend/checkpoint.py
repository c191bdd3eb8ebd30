"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, atomic, and resumable on another layout.

What is saved, under global names that do not depend on the layout (a run saved under DP2 x EP2 resumes under EP4,
a pipeline, or one process; `resume_problem` only refuses another model, optimizer, global batch or seed):
- model.<fqn>: every parameter and buffer under the full model's names (a rank holding pipeline chunks saves theirs,
  `global_view` merges them); expert stacks as the full [experts, ...] tensor, each expert-parallel rank's slice
  saved as its shard (`shard_of`: a DTensor over the expert-data x expert mesh, Replicate x Shard(0); FSDP-sharded
  expert slices over data x expert x the experts' FSDP shards, Replicate x Shard(0) x Shard(0)); the
  quantile-balancing state is the router bias, a parameter (its margins live within one step only);
- optim.state.<fqn>.<key> and optim.param_groups.<fqn>.<key>: the optimizer's state per parameter (MuonH momentum,
  Adam moments and step counts), through torch.distributed.checkpoint.state_dict.get_state_dict with the flattened
  optimizer layout, sharded like the parameter it belongs to;
- trainer.step (the data position: batches are a function of the step, backend.data), trainer.rows (the metric
  rows so far, from rank 0), trainer.routing (tokens routed per layer and expert, summed over ranks) and
  trainer.rng.<rank> (each rank's torch RNG state; a rank the saving run did not have takes rank 0's).
Parameters that are already DTensors (FSDP2, tensor parallelism) are saved as they are: DCP reshards them itself;
tensor parallelism's fused Q/K/V and gate/up rows, stored rank-major (backend.tensor_parallel.order_rows), are
saved and loaded in the one-process row order with their optimizer state (`orders`).

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
# Optimizer param-group entries that describe this process's parameters rather than training state (MuonH's fused
# parts, with the tensor-parallel row order, and roles, backend.optim): kept when a checkpoint is loaded, since the
# saving layout's may differ.
LAYOUT_GROUP_KEYS = ("parts", "roles")
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


def layout_info(plan) -> dict:
    """The parallel layout a run used, as checkpoints and records list it (informational: any layout resumes)."""
    p = plan.parallel
    return {"data": p.data, "fsdp": p.fsdp, "context": p.context, "expert": p.expert,
            "expert_tensor": p.expert_tensor, "pipeline": p.pipeline,
            "tensor": p.tensor, "sequence_parallel": p.sequence_parallel, "virtual": p.virtual,
            "schedule": plan.schedule}


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


def _global_shape(value, mesh, placements) -> torch.Size:
    """Shape of the global tensor whose shard on `mesh` with `placements` is `value`'s local part (a DTensor's
    global shape grows along each dim by the Shard placements the new mesh adds beyond the DTensor's own)."""
    from torch.distributed.tensor import DTensor, Shard

    shape = list(value.shape)
    old = value.device_mesh if isinstance(value, DTensor) else None
    for dim in range(len(shape)):
        new_ways = 1
        for size, pl in zip(mesh.shape, placements):
            new_ways *= size if isinstance(pl, Shard) and pl.dim == dim else 1
        old_ways = 1
        if old is not None:
            for size, pl in zip(old.shape, value.placements):
                old_ways *= size if isinstance(pl, Shard) and pl.dim == dim else 1
        shape[dim] = shape[dim] * new_ways // old_ways
    return torch.Size(shape)


def _globalise(state: dict, shard_of: ShardOf | None) -> tuple[dict, dict]:
    """Wrap each tensor that holds part of a parameter as a DTensor of its global tensor, so DCP records where it
    sits: a plain local slice (an expert-parallel slice), or an FSDP2 DTensor of such a slice (FSDP-sharded experts
    under expert parallelism: its local shard re-placed on the mesh shard_of names). Returns the state and, for the
    tensors it wrapped, what `_localise` needs to put them back (key -> None for a plain slice, or the FSDP2
    DTensor's mesh, placements, shape and stride)."""
    restore: dict = {}
    if shard_of is None:
        return state, restore
    from torch.distributed.tensor import DTensor

    def wrap(key, value, fqn):
        where = shard_of(fqn) if isinstance(value, torch.Tensor) and value.ndim else None  # not a 0-d step count
        if not where:
            return value
        mesh, placements = where
        local, restore[key] = value, None
        if isinstance(value, DTensor):
            restore[key] = (value.device_mesh, value.placements, value.shape, value.stride())
            local = value.to_local()
        shape = _global_shape(value, mesh, placements)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    model = {k: wrap(("model", k), v, k) for k, v in state["model"].items()}
    optim = {k: wrap(("optim", k), v, _optim_fqn(k)) if k.startswith("state.") else v
             for k, v in state["optim"].items()}
    return dict(state, model=model, optim=optim), restore


def _localise(values: dict, kind: str, restore: dict) -> dict:
    """The loaded values as set_state_dict takes them: what `_globalise` wrapped back as it was (a plain local slice,
    or an FSDP2 DTensor on its own mesh); the model's own DTensors (FSDP2, tensor parallelism) as loaded."""
    from torch.distributed.tensor import DTensor

    out = dict(values)
    for k, v in values.items():
        if (kind, k) not in restore or not isinstance(v, DTensor):
            continue
        back = restore[(kind, k)]
        if back is None:
            out[k] = v.to_local()
        else:
            mesh, placements, shape, stride = back
            out[k] = DTensor.from_local(v.to_local(), mesh, placements, run_check=False, shape=shape, stride=stride)
    return out


def _reorder(state: dict, orders: dict, inverse: bool = False) -> dict:
    """Tensor-parallel fused parameters (backend.tensor_parallel.order_rows) and their optimizer state in the
    one-process row order (inverse: back to the stored order, after a load). orders: fqn -> (dim, stored order)."""
    if not orders:
        return state
    from torch.distributed.tensor import DTensor, distribute_tensor

    def convert(value, fqn):
        if fqn not in orders or not isinstance(value, torch.Tensor) or value.ndim == 0:
            return value
        dim, stored = orders[fqn]
        full = value.full_tensor() if isinstance(value, DTensor) else value
        out = full.index_select(dim, stored) if inverse else full.new_empty(full.shape).index_copy_(dim, stored, full)
        return distribute_tensor(out, value.device_mesh, value.placements, src_data_rank=None) \
            if isinstance(value, DTensor) else out

    model = {k: convert(v, k) for k, v in state["model"].items()}
    optim = {k: convert(v, _optim_fqn(k)) if k.startswith("state.") else v for k, v in state["optim"].items()}
    return dict(state, model=model, optim=optim)


def _state(model: nn.Module, optimizer, shard_of: ShardOf | None, orders: dict | None = None) -> tuple[dict, dict]:
    """The model's and optimizer's state as DCP saves them (_globalise, then _reorder), and what _localise needs."""
    model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
    state, restore = _globalise({"model": model_state, "optim": optim_state}, shard_of)
    return _reorder(state, orders or {}), restore


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
             shard_of: ShardOf | None = None, fail_hook=None, orders: dict | None = None) -> Path:
        """Write `model`, `optimizer` and `extra` (trainer.* values: step, rows, routing, rng.<rank>, as the trainer
        passes them) into a temporary folder; rank 0 then marks it complete with `info` (plan identity, layout) and
        renames it to step-NNNNNNNN.

        model: a module whose parameter names are the full model's (`global_view` of the pipeline chunks);
        optimizer: the optimizer over its parameters. Wrapped or sharded models (DDP, FSDP2, DTensor parameters)
        work as torch.distributed.checkpoint.state_dict.get_state_dict handles them; shard_of says where a plain
        tensor holding only part of a parameter (an expert-parallel slice) sits in the global one; `orders` names
        the fused parameters stored in another row order (tensor parallelism), saved in the one-process order and
        loaded back into theirs (`load`)."""
        self.wait()
        tmp, final = _temp_dir(self.run_dir, step), step_dir(self.run_dir, step)
        if self.rank == 0:
            for stale in tmp.parent.glob(".tmp-step-*"):  # saves that a killed run left half-written
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        state, _ = _state(model, optimizer, shard_of, orders)
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


def load(folder: Path, model: nn.Module, optimizer, extra: dict, shard_of: ShardOf | None = None,
         orders: dict | None = None) -> dict:
    """Collective: fill `model` and `optimizer` from the checkpoint in `folder`, whatever layout wrote it, and
    return the trainer.* values named by `extra` (name -> a template value of the right type and shape; a name the
    checkpoint lacks is left out of the result)."""
    saved = saved_keys(folder)
    state, restore = _state(model, optimizer, shard_of, orders)
    state["trainer"] = {k: v for k, v in extra.items() if f"trainer.{k}" in saved}
    with _quiet():
        dcp.load(state, checkpoint_id=str(folder), no_dist=not dist.is_initialized())
    state = _reorder(state, orders or {}, inverse=True)
    # what _globalise wrapped goes back as it was; the model's own DTensors (FSDP2, tensor parallelism) stay DTensors
    layout_keys = [{k: g[k] for k in LAYOUT_GROUP_KEYS if k in g} for g in optimizer.param_groups]
    set_state_dict(model, optimizer, model_state_dict=_localise(state["model"], "model", restore),
                   optim_state_dict=_localise(state["optim"], "optim", restore), options=OPTIONS)
    for group, kept in zip(optimizer.param_groups, layout_keys):
        group.update(kept)
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
