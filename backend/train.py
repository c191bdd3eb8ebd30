"""The training worker: one process of a torchrun job executing a plan (started by `rackcast train PLAN`).

Per rank: build the model from the plan's ModelSpec and seed, keep this rank's pipeline chunks, expert slice and
sequence chunk (backend.pipeline, expert_parallel, expert_tensor, context_parallel), parallelise its matrices over the
tensor ranks (backend.tensor_parallel), wrap the dense parameters in DDP over the token ranks (data x fsdp x context,
backend.parallel; not under ZeRO-2, whose backend.zero reduces each gradient to its owner only), build the plan's
optimizer (backend.optim) and quantile balancer (its statistics pooled over them), then per optimizer step: this rank's
share of the global batch (backend.data) in micro-batches -> forward/backward (or the pipeline schedule) -> expert
gradient reduction -> optimizer -> balancer. Measures each step (backend.record), saves checkpoints (backend.checkpoint)
and resumes from the latest complete one. Garbage collection and the machine-speed probe: between steps only, untimed
(backend.step_gc, backend.speed_probe).

Peak memory: on CUDA torch.cuda.max_memory_allocated. On CPU every rank measures the peak bytes of live tensors during
one training step with the profiler (backend.memprof): the third step this process runs (MEMORY_STEP; the last one when
it runs fewer), because the first allocates the optimizer state and the second rebuilds DDP's gradient buckets,
once-only allocations. The profiler slows that step, so its row (`memory_profiled`) is left out of record.summary's
step-time medians; rows before it carry NaN for peak_memory_bytes. The process's peak resident set is kept as
peak_rss_bytes. A --profile Chrome trace covers the two steps after it (two profilers cannot run at once).

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 -m backend.train \
        --plan examples/plans/tiny-2proc-ep.yaml --steps 20 --out runs/tiny-2proc-ep
RACKCAST_FAIL injects failures for tests (backend.fault_injection).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from rackcast.atomic import write_json_atomic
from rackcast.backend import checkpoint, memprof, record, speed_probe, step_gc
from rackcast.backend.compiled import compile_blocks
from rackcast.backend.context_parallel import ContextShard, chunk_loss, sequence_chunk, shard_context
from rackcast.backend.attached_loss import AttachedLoss
from rackcast.backend.balancing import build_balancer
from rackcast.backend.data import TokenData, prepare
from rackcast.backend.expert_parallel import expert_shard_of, pop_drop_counts, shard_experts
from rackcast.backend.fault_injection import fail_hook
from rackcast.backend.launch import exit_with_parent
from rackcast.backend.model import build_model, next_token_loss, shifted_targets
from rackcast.backend.moe import MoE
from rackcast.backend.optim import build_optimizer, marin_lr_lambda
from rackcast.backend.parallel import (Groups, Layout, PhaseTimer, expert_tensor_presum, init_distributed,
                                      is_expert_param, reduce_grads, validate_trainable, wrap_data_parallel)
from rackcast.backend.fsdp import expert_checkpoint_mesh, set_gradient_sync, shard_model
from rackcast.backend.tensor_parallel import parallelize, reduce_partial_grads, stored_orders
from rackcast.backend.offload import HostOptimizer
from rackcast.backend.pipeline import Pipeline, build_chunks, chunk_ids
from rackcast.backend.recompute import apply_recompute
from rackcast.backend.zero import Zero
from rackcast.backend.cpu_runtime import configure_cpu_process
from rackcast.errors import RackcastError
from rackcast.modelspec import FlopsConvention
from rackcast.plan import inputs_hash, load_plan
from rackcast.vocab import MEASURED_PHASES

EVAL_SEQUENCES = 16
MEMORY_STEP = 2  # index, among this process's steps, of the step whose peak live tensor bytes are measured on CPU
TRACE_STEPS = 2  # steps the --profile Chrome trace covers
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="rackcast.backend.train", description=__doc__.splitlines()[0])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoint-every", type=int, default=0, help="0: only at the end")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--async-checkpoint", action="store_true",
                    help="write checkpoints in the background (dcp.async_save) after a copy of the state")
    ap.add_argument("--profile", action="store_true",
                    help="write a torch.profiler Chrome trace of two steps (2-3 on CUDA, 4-5 on CPU)")
    ap.add_argument("--data-dir", default="runs/.data")
    ap.add_argument("--eval-every", type=int, default=0, help="held-out loss every N steps (0: at the end only)")
    ap.add_argument("--log-every", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per process (0: backend.cpu_runtime.DEFAULT_THREADS)")
    ap.add_argument("--quiet", action="store_true")
    return ap.parse_args(argv)


class Trainer:
    def __init__(self, args):
        self.args = args
        self.plan = load_plan(args.plan)
        validate_trainable(self.plan, where=args.plan)
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != self.plan.parallel.gpus:  # before joining: a mismatched job would wait for ranks forever
            raise RackcastError(f"parallel: the plan needs {self.plan.parallel.gpus} processes, the launcher "
                                f"started {launched}", where=args.plan)
        self.rank, self.world, self.device = init_distributed()
        self.threads = 0
        if self.device.type == "cpu":
            self.threads = configure_cpu_process(args.threads, int(os.environ.get("LOCAL_RANK", "0")))
        self.cuda = self.device.type == "cuda"
        self.layout = lay = Layout.of(self.plan, self.rank)
        self.groups = Groups(lay, self.device) if self.world > 1 else None
        self.timer = PhaseTimer(self.cuda)
        self.probe = speed_probe.SpeedProbe(self.device, dist.barrier if self.world > 1 else None)
        self.spec = spec = self.plan.model_spec()
        self.out = Path(args.out)
        self.plan_hash = inputs_hash(self.plan)
        torch.manual_seed(self.plan.seed)

        if self.plan.attention_kernel == "materialized":  # SDPA's math backend only: the score matrix is held
            for enable in (torch.backends.cuda.enable_flash_sdp, torch.backends.cuda.enable_mem_efficient_sdp,
                           torch.backends.cuda.enable_cudnn_sdp):
                enable(False)  # these flags pick the SDPA kernel on CPU too (what nn.attention.sdpa_kernel sets)
        model = build_model(spec, seed=self.plan.seed, device=self.device, combine_sum=self.plan.combine_sum)
        et = self.plan.expert_transport
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            moe.balanced_routing = et.routing == "balanced"  # force-balanced choices (backend.moe)
        capacity = et.capacity_factor if et.mode == "capacity" else None
        self.moes = []
        if spec.moe is not None and (lay.ep > 1 or lay.etp > 1 or capacity is not None):
            g = self.groups
            self.moes = shard_experts(model, g.expert if g else None, lay.ep_rank, lay.ep, capacity, self.timer,
                                      etp=lay.etp, etp_rank=lay.etp_rank, etp_mesh=g.etp_mesh if g else None)
        self.cp = ContextShard(self.groups.cp, lay.cp_rank, lay.cp, self.timer) if lay.cp > 1 else None
        shard_context(model, self.cp)  # context parallelism: this rank holds chunk cp_rank of every sequence
        self.chunks = build_chunks(model, lay, self.plan.parallel, self.plan.schedule)
        # tensor parallelism before recompute wraps the blocks; the whole parameters with partial gradients back
        self.tp_partial = parallelize(self.chunks, self.groups, lay) if lay.tp > 1 else []
        apply_recompute(self.chunks, self.plan.recompute)
        if self.plan.compile:  # after recompute's wrapping, before DDP / FSDP wrap the chunks
            compile_blocks(self.chunks)
        self.chunk_index = chunk_ids(lay, self.plan.schedule)
        self.local = nn.ModuleList(self.chunks)
        # Keep only the MoE layers this rank's stages hold: a reference to the others would keep the whole model's
        # expert weights alive on every pipeline rank.
        held = {id(m) for m in self.local.modules()}
        self.moes = [m for m in self.moes if id(m) in held]
        del model
        self.view = checkpoint.global_view(self.chunks)  # this rank's parameters under the full model's names
        self.saver = checkpoint.Saver(self.out, asynchronous=args.async_checkpoint)
        self.fsdp = lay.fsdp > 1
        partial_names = [n for n, p in self.local.named_parameters() if any(p is q for q in self.tp_partial)]
        self.experts_sharded = self.fsdp and shard_model(self.chunks, self.groups, lay, self.plan, self.device)
        if self.fsdp and self.tp_partial:  # FSDP2 swapped the parameters: the partial-gradient ones again by name,
            # less the expert stacks it shards over fsdp x tp (their reduce-scatter already sums the tp ranks)
            now = dict(self.local.named_parameters())
            self.tp_partial = [now[n] for n in partial_names
                               if n in now and not (self.experts_sharded and is_expert_param(n))]
        # FSDP2 shards each rank's expert-parallel slice again: checkpoints record both splits of the expert dimension
        self.expert_mesh = expert_checkpoint_mesh(lay, self.device) \
            if self.experts_sharded and (lay.ep > 1 or lay.etp > 1) else None
        self.zero2 = self.plan.parallel.zero == 2 and self.groups is not None  # gradients reduced to owners only
        # tensor-parallel DTensors: no DDP, a flat all-reduce instead; ZeRO-2: DDP would all-reduce every gradient
        if self.fsdp or lay.pp > 1 or lay.tp > 1 or self.zero2:
            self.wrapped = self.chunks
        else:
            self.wrapped = [wrap_data_parallel(self.chunks[0], self.groups, lay, self.timer)]
        o = self.plan.optimizer
        self.optimizer = build_optimizer(self.local, o.name, lr=o.lr, adam_lr=o.adam_lr if o.name == "muonh" else None,
                                         betas=tuple(o.betas), eps=o.eps, momentum=o.momentum,
                                         weight_decay=o.weight_decay)
        if o.state_location == "host":
            self.optimizer = HostOptimizer(self.optimizer)
        for g in self.optimizer.param_groups:
            g["initial_lr"] = g["lr"]
        self.zero = Zero(self.local.named_parameters(), self.groups.dp, self.groups.edp, is_expert_param,
                         stage=self.plan.parallel.zero, presum=expert_tensor_presum(self.chunks, self.groups, lay)) \
            if self.plan.parallel.zero and self.groups else None
        self.lr_factor = marin_lr_lambda(args.steps, o.warmup_fraction, o.lr_floor)
        dp_group = self.groups.stage if self.groups else None  # dp, or dp x tp under sequence parallelism
        reduce_sum = (lambda t: dist.all_reduce(t, group=dp_group)) if dp_group else None
        reduce_max = (lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dp_group)) if dp_group else None
        self.balancer = build_balancer(self.local, spec, reduce_sum, reduce_max)
        self.microbatches = self.plan.microbatches
        AttachedLoss.backward_scale = 1.0 / self.microbatches  # MTP and auxiliary losses, as the main loss is scaled
        self.pipe = Pipeline(self.wrapped, self.chunk_index, lay, self.plan.schedule, self.microbatches,
                             self._pipeline_loss, self.groups, self.device, self.timer) if lay.pp > 1 else None
        self.has_last = lay.pp * lay.virtual - 1 in self.chunk_index
        self.routing = torch.zeros(spec.layers, spec.moe.experts if spec.moe else 1, dtype=torch.int64)
        self.rows: list[dict] = []
        self.start_step = 0
        topo = self.plan.topology_spec()
        self.peak_dtype = topo.peak_dtype(self.plan.precision)  # the dtype matmuls run in, as the simulator prices
        self.param_dtype = DTYPE_NAMES.get(next(self.local.parameters()).dtype, "other")
        self.memory_measure = "cuda max_memory_allocated" if self.cuda else "torch profiler live tensor bytes"
        self.memory_peak = -1.0  # CPU: the measured peak live tensor bytes of this rank (-1: not measured yet)
        self.peak = topo.peak_flops(self.peak_dtype)
        self.peak_bf16 = topo.peak_flops("bf16")
        self.tokens_per_step = self.plan.tokens_per_step(spec)
        self.model_flops = spec.flops_per_token_train(FlopsConvention()) * self.tokens_per_step
        self.fail = fail_hook(self.rank)

    # ------------------------------------------------------------------------------------------------ data
    def _data(self):
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # one builder per machine (the cache may be node-local)
            prepare(self.args.data_dir)
        if self.world > 1:
            dist.barrier()
        folder = prepare(self.args.data_dir)
        self.train_data = TokenData(folder, "train", self.spec.seq_len, seed=self.plan.seed)
        self.eval_data = TokenData(folder, "eval", self.spec.seq_len, seed=self.plan.seed)

    # ------------------------------------------------------------------------------------------------ step
    def _loss(self, logits, tokens, targets):
        return next_token_loss(logits, tokens, targets=targets, z_loss_weight=self.plan.z_loss_weight)

    def _pipeline_loss(self, out, tgt):
        """The last stage's loss of one micro-batch. Under context parallelism `tgt` is this rank's chunk of the
        targets with one more column, each whole sequence's count of counted targets (train_step appends it, so it
        travels with its rows however the schedule splits the micro-batches): the loss is scaled as
        backend.context_parallel.token_scale scales it, counted here x context / counted in the whole sequences."""
        if self.cp is None:
            return self._loss(out, None, tgt)[0]
        tgt, whole = tgt[:, :-1], tgt[:, -1]
        here = (tgt != -100).sum().item()
        return self._loss(out, None, tgt)[0] * (here * self.cp.size / max(whole.sum().item(), 1))

    def _autocast(self):
        """The plan's precision: bf16 autocast on CUDA or CPU, none for fp32."""
        if self.plan.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _to_device(self, tokens: torch.Tensor) -> torch.Tensor:
        """Host batch -> device: on CUDA through pinned memory, copied without blocking the host."""
        return tokens.pin_memory().to(self.device, non_blocking=True) if self.cuda else tokens

    def _cpp_storages(self) -> list[tuple[int, int]]:
        """(address, bytes) of storages only C++ holds between steps: DDP's gradient buckets (backend.parallel)."""
        return [st for w in self.wrapped for st in getattr(w, "gradient_buckets", {}).values()]

    def train_step(self, step: int) -> tuple[float, float, float, int]:
        lay = self.layout
        for w in self.wrapped:
            getattr(w, "gradient_buckets", {}).clear()  # refilled by this step's backward
        tokens = self._to_device(
            torch.from_numpy(self.train_data.batch(step, self.plan.batch.global_batch, lay.dp_rank, lay.dp)))
        targets = shifted_targets(tokens)
        loss_sum = ce_sum = z_sum = 0.0
        count = 0
        t0 = self.timer.now()
        if self.pipe is not None:
            if self.cp is not None:  # each rank's chunk of every sequence (backend.context_parallel)
                counted = (targets != -100).sum(dim=1, keepdim=True)  # per whole sequence (see _pipeline_loss)
                tokens, targets = sequence_chunk(tokens, self.cp), torch.cat([sequence_chunk(targets, self.cp),
                                                                              counted], dim=1)
            with self._autocast():
                losses = self.pipe.step(tokens, targets)
            span = self.timer.now() - t0
            work = self.timer.totals.pop("pipeline_stage_work", 0.0)
            self.timer.add("pipeline_bubble", max(0.0, span - work))
            self.timer.add("fwd_bwd", work)
            if self.has_last:
                loss_sum, count = float(sum(x.item() for x in losses)), len(losses)
        else:
            module = self.wrapped[0]
            for i, (x, y) in enumerate(zip(tokens.chunk(self.microbatches), targets.chunk(self.microbatches))):
                sync = i == self.microbatches - 1 or not hasattr(module, "no_sync")
                if self.fsdp:
                    set_gradient_sync(self.chunks, i == self.microbatches - 1)
                with (contextlib.nullcontext() if sync else module.no_sync()), self._autocast():
                    loss, parts = chunk_loss(self._loss, module, x, y, self.cp)
                (loss / self.microbatches).backward()
                if self.zero2:  # backend.zero: this micro-batch's gradients to their owners only
                    self.zero.reduce_to_owners(lay.tokens, self.timer, last=i == self.microbatches - 1,
                                               expert_divide=lay.expert_divide)
                loss_sum, ce_sum, z_sum = loss_sum + loss.item(), ce_sum + parts["ce"].item(), \
                    z_sum + parts["z_loss"].item()
                count += 1
            self.timer.add("fwd_bwd", self.timer.now() - t0)
        if self.tp_partial:
            reduce_partial_grads(self.tp_partial, self.groups, self.timer)
        if self.zero2 and self.pipe is not None:  # backend.zero: the schedule ran every micro-batch
            self.pipe.sum_embedding_grads()  # before: the two stages' owners of the embedding may differ
            self.zero.reduce_to_owners(lay.tokens, self.timer, expert_divide=lay.expert_divide)
        elif self.groups is not None and not self.zero2:
            reduce_grads(self.chunks, self.groups, lay, self.timer,
                         dense=(self.pipe is not None or lay.tp > 1) and not self.fsdp, experts=not self.experts_sharded)
            if self.pipe is not None:  # after the data-parallel average (Megatron-LM's order): one sum on both
                self.pipe.sum_embedding_grads()
        t1 = self.timer.now()
        for g in self.optimizer.param_groups:
            g["lr"] = g["initial_lr"] * self.lr_factor(step)
        self.zero.step(self.optimizer) if self.zero else self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.balancer.step()
        self.timer.add("optimizer", self.timer.now() - t1)
        return loss_sum, ce_sum, z_sum, count

    def _collect_routing(self) -> None:
        for chunk in self.chunks:
            for name, layer in chunk.layers.items():
                moe = layer.mlp
                if getattr(moe, "routing_counts_sum", None) is not None:
                    if self.layout.tp_rank == 0 or self.layout.sequence_parallel:  # tp ranks route the same tokens
                        self.routing[int(name)] += moe.routing_counts_sum.cpu()
                    moe.reset_routing_counts()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Held-out loss on a fixed batch (NaN under pipeline parallelism: no forward-only schedule here)."""
        if self.pipe is not None:
            return math.nan
        lay = self.layout
        tokens = self._to_device(torch.from_numpy(self.eval_data.eval_batch(EVAL_SEQUENCES, lay.dp_rank, lay.dp)))
        self.local.eval()
        with self._autocast():
            loss, _ = chunk_loss(self._loss, self.chunks[0], tokens, shifted_targets(tokens), self.cp)
        self.local.train()
        for chunk in self.chunks:
            for layer in chunk.layers.values():
                if hasattr(layer.mlp, "reset_routing_counts"):
                    layer.mlp.reset_routing_counts()
        pop_drop_counts(self.moes)
        out = torch.tensor([loss.item()], dtype=torch.float64)
        if self.groups is not None and self.groups.dp is not None:
            dist.all_reduce(out, group=self.groups.dp)  # the token ranks: data x fsdp x context
            out /= lay.tokens
        return float(out[0])

    # ------------------------------------------------------------------------------------------------ state
    def _checkpoint_info(self) -> dict:
        return {"identity": checkpoint.identity(self.plan), "plan_hash": self.plan_hash, "world": self.world,
                "layout": checkpoint.layout_info(self.plan)}

    def save(self, step: int) -> None:
        routing = self.routing.clone()
        if self.world > 1:
            dist.all_reduce(routing)  # the run's total so far: any layout can continue it
        extra = {"step": step, "routing": routing, f"rng.{self.rank}": torch.get_rng_state()}
        if self.rank == 0:
            extra["rows"] = json.dumps(self.rows)  # one string: exact floats, NaN kept
        self.saver.save(step, self.view, getattr(self.optimizer, "inner", self.optimizer), extra,
                        self._checkpoint_info(), expert_shard_of(self.groups, self.layout, self.expert_mesh),
                        fail_hook=lambda where: self.fail(where), orders=stored_orders(self.view))
        if self.rank == 0:
            record.write_metrics(self.out, self.rows)

    def resume(self) -> None:
        folder = checkpoint.latest_complete(self.out)
        if folder is None:
            raise RackcastError(f"resume: {self.out} holds no complete checkpoint to continue from", option="resume")
        problem = checkpoint.resume_problem(folder, self.plan)
        if problem:
            raise RackcastError(f"resume: {folder} {problem}", where=self.args.plan, option="resume")
        own_rng = f"rng.{self.rank}"
        wanted = {"step": 0, "routing": torch.zeros_like(self.routing), own_rng: torch.get_rng_state(),
                  "rng.0": torch.get_rng_state()}
        if self.rank == 0:
            wanted["rows"] = ""
        got = checkpoint.load(folder, self.view, getattr(self.optimizer, "inner", self.optimizer), wanted,
                              expert_shard_of(self.groups, self.layout, self.expert_mesh), orders=stored_orders(self.view))
        if hasattr(self.optimizer, "sync_from_device"):
            self.optimizer.sync_from_device()  # host copies of the loaded weights
        if self.zero is not None:
            self.zero.drop_foreign_state(self.optimizer)
        torch.set_rng_state(got.get(own_rng, got["rng.0"]))  # a rank the saving run did not have takes rank 0's
        self.routing = got["routing"] if self.rank == 0 else torch.zeros_like(self.routing)
        self.rows = json.loads(got["rows"]) if self.rank == 0 else []
        self.start_step = int(got["step"])
        if self.rank == 0 and not self.args.quiet:
            print(f"resumed from {folder} (step {self.start_step})", flush=True)

    # ------------------------------------------------------------------------------------------------ loop
    def _peak_memory(self) -> float:
        return float(record.peak_memory_bytes(self.device)) if self.cuda else self.memory_peak

    def _reduce_stats(self, loss_sum, ce_sum, z_sum, count, phases, step_time, step_cpu, probe_s) -> dict:
        dropped, assigned = pop_drop_counts(self.moes)
        names = list(MEASURED_PHASES)
        # One row per rank (a sum of rows zero elsewhere): the record keeps the slowest rank's figures beside the means
        per_rank = torch.zeros(self.world, record.PHASE_COLUMN + len(names), dtype=torch.float64)
        figures = dict(loss=loss_sum, ce=ce_sum, z_loss=z_sum, micro_batches=count, dropped=dropped, assigned=assigned,
                       step_s=step_time, step_cpu_s=step_cpu, probe_s=probe_s)
        figures |= {n: phases.get(n, 0.0) for n in names}
        per_rank[self.rank] = torch.tensor([figures[c] for c in (*record.STEP_COLUMNS, *names)], dtype=torch.float64)
        mem = torch.tensor([self._peak_memory(), record.peak_rss_bytes()], dtype=torch.float64)
        if self.world > 1:
            dist.all_reduce(per_rank)
            dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        return record.step_row(per_rank, mem, names, tokens_per_step=self.tokens_per_step,
                               model_flops=self.model_flops, peak_flops=self.peak, pipeline=self.pipe is not None)

    def run(self) -> None:
        args = self.args
        self._data()
        self.out.mkdir(parents=True, exist_ok=True)
        if args.resume:
            self.resume()
        profiler = None
        if args.profile and self.rank == 0:  # after the memory-measured step on CPU
            profiler = memprof.chrome_trace(self.out / "trace.json", self.cuda, 1 if self.cuda else MEMORY_STEP + 1,
                                            TRACE_STEPS)
        memory_step = self.start_step + min(MEMORY_STEP, args.steps - self.start_step - 1)
        with step_gc.StepBoundaryGC() as boundary:  # collections between steps only, outside their timing
            for step in boundary.steps(range(self.start_step, args.steps)):
                self.fail("step", step)
                self.saver.poll()
                self.timer.pop()
                profiled = not self.cuda and step == memory_step
                probe_s = self.probe.time()  # the machine's speed at this boundary, untimed (backend.speed_probe)
                t0, cpu0 = self.timer.now(), time.process_time()
                if profiled:
                    stats, peak = memprof.profile_peak(self.train_step, step, extra=self._cpp_storages())
                    self.memory_peak = max(self.memory_peak, float(peak.total_bytes))
                else:
                    stats = self.train_step(step)
                loss_sum, ce_sum, z_sum, count = stats
                step_time, step_cpu = self.timer.now() - t0, time.process_time() - cpu0
                phases = record.step_phases(self.timer.pop(), step_time)
                self._collect_routing()
                row = {"step": step + 1, "lr": self.optimizer.param_groups[0]["lr"],
                       **self._reduce_stats(loss_sum, ce_sum, z_sum, count, phases, step_time, step_cpu, probe_s),
                       "memory_profiled": profiled}
                last = step + 1 == args.steps
                do_eval = last or (args.eval_every and (step + 1) % args.eval_every == 0)
                row["eval_loss"] = self.evaluate() if do_eval else math.nan
                row["plan_hash"] = self.plan_hash
                self.rows.append(row)
                if profiler is not None:
                    profiler.step()
                if self.rank == 0 and not args.quiet and (last or step % max(1, args.log_every) == 0):
                    print(record.progress_line(row, args.steps), flush=True)
                if (last or (args.checkpoint_every and (step + 1) % args.checkpoint_every == 0)):
                    self.save(step + 1)
        if profiler is not None:
            profiler.stop()
        self.saver.wait()
        self.finish()

    def finish(self) -> None:
        routing = self.routing.clone()
        per_rank = torch.zeros(self.world, dtype=torch.float64)
        per_rank[self.rank] = self._peak_memory()
        if self.world > 1:
            dist.all_reduce(routing)
            dist.all_reduce(per_rank)
        if self.rank != 0 or not self.rows:
            return
        record.write_metrics(self.out, self.rows)
        if self.spec.moe is not None:
            record.write_routing(self.out, {i: routing[i].tolist() for i in range(self.spec.layers)
                                            if self.spec.is_moe(i)})
        p = self.plan.parallel
        info = {"plan": self.plan.name, "plan_path": self.args.plan, "plan_hash": self.plan_hash,
                "model": self.spec.name, "world": self.world, "device": str(self.device),
                "layout": {**checkpoint.layout_info(self.plan), "expert_transport": self.plan.expert_transport.mode,
                           "data_parallel": "fsdp2" if p.fsdp > 1 else "zero2 reduce to owners" if self.zero2
                           else "ddp" if p.pipeline == p.tensor == 1 else "flat all-reduce"},
                "torch": torch.__version__, "threads": self.threads, "tokens_per_step": self.tokens_per_step,
                "model_flops_per_step": self.model_flops, "flops_convention": FlopsConvention().label,
                "peak_flops": self.peak, "peak_dtype": self.peak_dtype, "peak_flops_bf16": self.peak_bf16,
                "memory_measure": self.memory_measure, "param_dtype": self.param_dtype,
                "peak_memory_per_rank_bytes": [int(v) if v >= 0 else math.nan for v in per_rank.tolist()],
                "activation_dtype": self.peak_dtype, "compile": self.plan.compile,
                "routing_histogram": "routing.parquet" if self.spec.moe is not None else ""}
        write_json_atomic(self.out / "record.json", record.summary(self.rows, **info))


def main(argv=None) -> int:
    args = parse_args(argv)
    exit_with_parent()  # a worker whose launcher was killed stops too (backend.launch)
    if os.environ.get("RACKCAST_HANG_DUMP"):  # debugging aid: print every thread's stack after N seconds and exit
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["RACKCAST_HANG_DUMP"]), exit=True)
    try:
        trainer = Trainer(args)
        trainer.run()
        # Tear down in order: every rank done with its collectives, then the DDP reducer and pipeline stages
        # (which hold process groups and gloo threads) freed, then the groups. A rank that closed its connections
        # while a peer's gloo thread still used them made that peer abort ("terminate called without an active
        # exception") now and then.
        if dist.is_initialized():
            dist.barrier()
        del trainer
        gc.collect()
    except RackcastError as exc:
        print(f"rackcast train: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
