"""Count the framework ops (aten calls, as torch's dispatcher sees them) the backend runs for one micro-batch of a
model, split by where they run, and for one optimizer step. With the measured host time per op
(EfficiencyProfile.host_op_s, from `rackcast calibrate`), simulator.host_overhead turns the counts into the host
overhead of a plan's step: the cost that dominates when kernels are tiny (small models on a CPU). The simulator reads
the counts as data (simulator.op_counts): this module writes them, into the op-count cache (`count_into_cache`, for a
model of one's own) or into the table packaged with the simulator (`write_count_table`, its TABLE_MODELS).

Counts (one micro-batch, forward; backward as one ratio, since autograd runs outside module hooks): embed
(embedding and its norms), per layer (including its routed experts), per layer the routed experts alone (the
GroupedExperts grouped GEMMs, the same ops whatever the number of experts a rank holds), head (final norm, head and
loss);
bwd_over_fwd; optimizer ops for one step with the plan's optimizer and the parameter tensors; for MoE models the ops
the expert-parallel dispatch path adds per MoE layer, forward (ep_fwd) and backward (ep_bwd) apart, and those
capacity mode adds to it (capacity_fwd, capacity_bwd) (`count_ep_dispatch`: the real backend.expert_parallel code
against backend.moe's one-process path, the collectives looped back outside the count; the same at any expert
degree and number of local experts, so counted at the smallest degree; no expert tensor parallelism); per step, the
step's end (step_ops: the router balancer's step, as the trainer builds it, whose forward also records routing
margins; zero_grad) and the trainer's gradient reduction (`count_grad_reduction`: DDP's ops on a one-rank gloo
group, reduce_grads' flat expert and dense reductions). Op counts do not
depend on sizes (only on the structure; DDP's per-bucket ops aside), so short sequences (simulator.op_counts.COUNT_SEQ
tokens, at least MIN_SEQUENCES of them) are counted on
the model's structural twin (simulator.op_counts.structural_twin: the same structure at widths of a few units, so a
535B preset counts in about ten seconds; twin=False counts the model as given). Every expert gets rows (no empty
grouped-GEMM group), as in a training micro-batch of thousands of tokens: each MoE layer's routing is replaced,
after it has run, by a balanced assignment (token t's k-th choice is expert (t K + k) mod E) over enough sequences
that every expert gets a row, so the count does not depend on which experts a few random tokens happen to reach.

Bytes (`count_bytes`; simulator.op_bytes reads them): the bytes each framework op that is neither a matrix product
nor an attention core reads and writes (UNPRICED_OPS: those are priced by FLOPs; views move nothing), by the same
tags, on the model as given (bytes depend on widths and tokens, so not on the twin), at its seq_len: two and three
sequences per micro-batch, so that bytes(b sequences) = fixed + per_sequence x b exactly for b >= 2 (every op is
batched per sequence; tests/test_op_bytes.py checks four). Not from one: at one sequence some reshapes are views
(a size-1 dimension's stride is free) that copy at two or more, so one sequence is slightly overcounted. A tensor's
bytes are those its strides reach (a broadcast operand, stride 0, is read once); an embedding lookup reads the rows
it writes, not its whole table. Only models of at most
simulator.op_bytes.MAX_PARAMS parameters are counted (they must be instantiated, in fp32, with their optimizer state,
on this CPU).

    rackcast calibrate --op-counts path/to/model.yaml       # count_into_cache, both optimizers (and bytes)
    rackcast calibrate --op-counts-table                     # write_count_table: regenerate simulator/op_counts.json
                                                             # and simulator/op_bytes.json
"""

from __future__ import annotations

import contextlib
import copy
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from rackcast.backend import expert_parallel, parallel
from rackcast.backend.balancing import build_balancer
from rackcast.backend.model import build_model, next_token_loss
from rackcast.backend.moe import GroupedExperts, MoE, balanced_assignment
from rackcast.backend.optim import build_optimizer
from rackcast.modelspec import ModelSpec
from rackcast.presets import load_model
from rackcast.simulator import op_bytes as byte_data
from rackcast.simulator import op_counts as data
from rackcast.simulator.op_counts import COUNT_SEQ, structural_twin
from rackcast.spread import undisturbed


_aten = torch.ops.aten
# Priced by FLOPs elsewhere (simulator.costs: GEMM, grouped GEMM and attention efficiencies), so not as bytes: the
# matrix products (linear and matmul reach the dispatcher as these) and the fused attention kernels with their
# backwards. SDPA's math fallback is not here: its pieces (softmax, masking) are memory-bound eager ops.
UNPRICED_OPS = frozenset({
    _aten.mm, _aten.bmm, _aten.addmm, _aten.addbmm, _aten.baddbmm, _aten.matmul, _aten.linear, _aten._grouped_mm,
    _aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_flash_attention_backward,
    _aten._scaled_dot_product_flash_attention_for_cpu, _aten._scaled_dot_product_flash_attention_for_cpu_backward,
    _aten._scaled_dot_product_efficient_attention, _aten._scaled_dot_product_efficient_attention_backward,
    _aten._flash_attention_forward, _aten._flash_attention_backward, _aten._efficient_attention_forward,
    _aten._efficient_attention_backward,
    _aten._unsafe_view,  # a view by another name (matmul's reshape of its output): moves nothing
})
# Sequences per counted micro-batch, at least: at one, some reshapes are views (a size-1 dimension's stride is free)
# that copy at two or more (tiny-moe: 8 forward ops a micro-batch fewer), and training micro-batches hold several
MIN_SEQUENCES = 2
GATHERS = frozenset({_aten.embedding})  # read only the rows they write: counted as indices + output, twice the rows


def touched_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements a tensor's strides reach: a broadcast (stride-0) dimension is one element."""
    n = t.element_size()
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride else 1
    return n


def op_bytes(func, args, kwargs, out) -> int:
    """Bytes an op reads (tensor arguments) and writes (tensor results); 0 for views and UNPRICED_OPS."""
    packet = func.overloadpacket
    if func.is_view or packet in UNPRICED_OPS:
        return 0
    if packet in GATHERS:
        rows = touched_bytes(out)
        return rows + touched_bytes(args[1]) + rows
    leaves = tree_leaves((args, kwargs, out))
    return sum(touched_bytes(t) for t in leaves if isinstance(t, torch.Tensor))


class _Counter(TorchDispatchMode):
    def __init__(self, with_bytes: bool = False):
        super().__init__()
        self.tags: list[str] = []
        self.counts: dict[str, int] = {}
        self.moved: dict[str, int] | None = {} if with_bytes else None


def _count_op(self: _Counter, func, types, args=(), kwargs=None):
    tag = self.tags[-1] if self.tags else "untagged"
    self.counts[tag] = self.counts.get(tag, 0) + 1
    out = func(*args, **(kwargs or {}))
    if self.moved is not None:
        self.moved[tag] = self.moved.get(tag, 0) + op_bytes(func, args, kwargs or {}, out)
    return out


# Set after the class is made: a __torch_dispatch__ in the class body is wrapped to keep torch.compile out of it,
# which costs more than the count itself per op (a third of a 535B twin's count); nothing here is compiled.
_Counter.__torch_dispatch__ = _count_op


def _tag(module, counter: _Counter, name: str) -> None:
    def enter(m, a):
        counter.tags.append(name)

    def leave(m, a, o):  # returning None keeps the module's output
        counter.tags.pop()

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def _route_to_every_expert(moe: MoE, tokens: int) -> None:
    """Make `moe` route `tokens` tokens in balance over all of its experts: its own routing still runs (its ops are
    counted), then token t's k-th expert becomes (t K + k) mod E (backend.moe.balanced_assignment, a slice of a
    [tokens, K + 1] tensor as the routing's own top-(K+1) slice is, so the dispatch makes the same ops)."""
    ids = balanced_assignment(tokens, moe.top_k, moe.num_experts)
    route = moe.route

    def balanced(x):
        _, weights = route(x)
        return ids, weights

    moe.route = balanced


def _prepared(spec: ModelSpec, batch: int, seq: int, with_bytes: bool = False):
    """The backend model of `spec` with its modules tagged for a counter, routing `batch` sequences of `seq` tokens
    over every expert, warmed up; returns (model, counter, tokens)."""
    torch.manual_seed(0)
    net = build_model(spec, seed=0, device=torch.device("cpu"))
    for moe in net.moe_layers().values():
        _route_to_every_expert(moe, batch * seq)
    counter = _Counter(with_bytes)
    _tag(net.embed, counter, "embed")
    for i, layer in enumerate(net.layers):
        _tag(layer, counter, f"layer{i}")
        for sub in layer.modules():
            if isinstance(sub, GroupedExperts):
                _tag(sub, counter, f"experts{i}")
    _tag(net.head, counter, "head")
    net.balancer = build_balancer(net, spec)  # as the trainer: its forward records the routing margins
    tokens = torch.randint(0, spec.vocab, (batch, seq))
    with torch.no_grad():  # warm-up outside the counter: the rotary tables and window masks are made once, lazily
        net(tokens)
    return net, counter, tokens


def _step(net, counter: _Counter, tokens, optimizer: str, field: str) -> tuple[dict, int, int, int]:
    """One counted training step: the counter's `field` ("counts" or "moved") of the forward by tag, and the
    backward's, a (second) optimizer step's and the step's end's (the balancer's step, zero_grad: step_ops)
    totals."""
    with counter:
        loss, _ = next_token_loss(net(tokens), tokens)
    fwd = dict(getattr(counter, field))
    setattr(counter, field, {})
    with counter:
        loss.backward()
    bwd = sum(getattr(counter, field).values())
    opt = build_optimizer(net, optimizer, lr=1e-3, adam_lr=1e-3 if optimizer == "muonh" else None)
    opt.step()  # state initialisation happens on the first step; count a later one
    setattr(counter, field, {})
    with counter:
        opt.step()
    opt_total = sum(getattr(counter, field).values())
    setattr(counter, field, {})
    with counter:
        net.balancer.step()
        opt.zero_grad(set_to_none=True)
    return fwd, bwd, opt_total, sum(getattr(counter, field).values())


@contextlib.contextmanager
def _one_rank_group():
    """A gloo process group of this process alone for the block (destroyed after): DDP's reducer and comm hook run
    as on any data-parallel rank, their all-reduces over one rank."""
    if torch.distributed.is_initialized():
        raise RuntimeError("counting DDP's ops needs a process without a process group")
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield torch.distributed.group.WORLD
    finally:
        torch.distributed.destroy_process_group()


def count_grad_reduction(net, tokens) -> dict[str, int]:
    """The ops of the trainer's gradient reduction (backend.parallel) for one step of `net` on `tokens`, the whole
    model's parameters on one rank: ddp_ops, what DDP (wrap_data_parallel: the dense parameters, gradients as
    bucket views, the trainer's comm hook) adds to a forward and backward (per dense parameter, its gradient copied
    into its bucket and re-viewed there; per bucket the hook's average and all-reduce), after the two steps that
    build the buckets; expert_reduce_ops and dense_reduce_ops, reduce_grads' flat reduction of the expert gradients
    and (pipeline and tensor-parallel ranks, which DDP does not wrap) of the dense ones (a concatenation, the
    average, a copy back per gradient; the all-reduce itself is not counted: no group). The twin's gradients fill
    one bucket; a model whose dense gradients fill more (DDP's bucket_cap_mb) runs two more ops per further bucket,
    left out: a few ops a step against the thousands counted."""
    def fwd_bwd(module, counter=None) -> int:
        with counter or contextlib.nullcontext():
            next_token_loss(module(tokens), tokens)[0].backward()
        return sum(counter.counts.values()) if counter else 0

    fwd_bwd(net)  # warm-up: the rotary tables and window masks are made on the first forward
    net.zero_grad(set_to_none=True)
    bare = fwd_bwd(net, _Counter())
    ranks, reduce_layout = SimpleNamespace(edp=None, dp=None, etp=None), SimpleNamespace(tokens=2, expert_divide=2,
                                                                                            etp=1)
    flat = {}
    for key, dense, experts in (("expert_reduce_ops", False, True), ("dense_reduce_ops", True, False)):
        counter = _Counter()
        with counter:
            parallel.reduce_grads([net], ranks, reduce_layout, parallel.PhaseTimer(), dense=dense, experts=experts)
        flat[key] = sum(counter.counts.values())
    with _one_rank_group() as group:
        ddp = parallel.wrap_data_parallel(net, SimpleNamespace(dp=group), SimpleNamespace(tokens=2),
                                          parallel.PhaseTimer())
        for _ in range(2):
            ddp.zero_grad(set_to_none=True)
            fwd_bwd(ddp)
        ddp.zero_grad(set_to_none=True)
        wrapped = fwd_bwd(ddp, _Counter())
    return {"ddp_ops": wrapped - bare, **flat}


def _loopback(out, x, output_split_sizes=None, input_split_sizes=None, group=None):
    """all_to_all_single as a symmetric peer answers it: every rank sends what it receives (a copy outside any
    counter: the collective is not an op of the dispatch path)."""
    with _disable_current_modes():
        out.copy_(x)


@contextlib.contextmanager
def loopback_all_to_all():
    """backend.expert_parallel's all_to_all_single replaced by `_loopback` inside the block (restored after), so the
    expert-parallel path runs in one process without a process group."""
    real = expert_parallel.dist.all_to_all_single
    expert_parallel.dist.all_to_all_single = _loopback
    try:
        yield
    finally:
        expert_parallel.dist.all_to_all_single = real


def dispatch_ops(moe: MoE, ids: torch.Tensor, weights: torch.Tensor) -> tuple[int, int]:
    """Ops of one `moe.dispatch_compute_combine` on balanced `ids`, forward and backward (its gradient through the
    rows), counted by _Counter after one uncounted warm-up call."""
    def call(counter: _Counter | None = None) -> None:
        x = torch.randn(ids.shape[0], moe.experts.w_down.shape[-1], requires_grad=True)
        with counter or contextlib.nullcontext():
            if counter:
                counter.tags.append("forward")
            y = moe.dispatch_compute_combine(x, ids, weights)
            if counter:
                counter.tags.append("backward")
            y.sum().backward()

    call()
    counter = _Counter()
    call(counter)
    return counter.counts.get("forward", 0), counter.counts.get("backward", 0)


def count_ep_dispatch(spec: ModelSpec, ep: int, tokens: int) -> dict[str, int]:
    """The framework ops backend.expert_parallel.ExpertParallelMoE (as rank 0 of `ep` expert ranks) adds to one MoE
    layer's dispatch_compute_combine, forward and backward apart, for `tokens` tokens routed in balance: ep_fwd /
    ep_bwd, the dropless path's over the one-process path (backend.moe.MoE; the per-expert counts' exchange, the
    split sizes' host copies, the regrouping by local expert and its inverse, the rows' exchanges' autograd nodes;
    0 at ep 1); capacity_fwd / capacity_bwd, capacity mode's over the dropless path (each expert's slots cut at its
    capacity, which the trainer runs at any ep). Every all_to_all_single is a loopback outside the count
    (`loopback_all_to_all`)."""
    torch.manual_seed(0)
    whole = MoE(spec)
    dropless, capacity = copy.deepcopy(whole), copy.deepcopy(whole)
    expert_parallel.shard_experts(dropless, ep_group=None, ep_rank=0, ep=ep, capacity_factor=None)
    expert_parallel.shard_experts(capacity, ep_group=None, ep_rank=0, ep=ep, capacity_factor=1.0)
    ids = balanced_assignment(tokens, spec.moe.top_k, spec.moe.experts)
    weights = torch.rand(tokens, spec.moe.top_k)
    with loopback_all_to_all():
        (base_f, base_b), (ep_f, ep_b), (cap_f, cap_b) = (dispatch_ops(m, ids, weights)
                                                          for m in (whole, dropless, capacity))
    return {"ep_fwd": ep_f - base_f, "ep_bwd": ep_b - base_b, "capacity_fwd": cap_f - ep_f,
            "capacity_bwd": cap_b - ep_b}


def count_ops(model, optimizer: str = "muonh", seq: int = COUNT_SEQ, twin: bool = True) -> dict:
    """Counts for a model preset name, YAML path or ModelSpec (see the module docstring); twin=False counts the
    model as given, on its own seq_len, instead of its structural twin (the same counts, at the full model's
    cost)."""
    spec = model if isinstance(model, ModelSpec) else load_model(model)
    name = spec.name
    if twin:
        spec = structural_twin(spec, seq)
    s = spec.seq_len  # the twin's is at most `seq`; a model as given is counted on what it trains on
    batch = MIN_SEQUENCES
    if spec.moe is not None:  # sequences enough for every expert to get a row: tokens x top_k >= experts
        batch = max(batch, -(-spec.moe.experts // (spec.moe.top_k * s)))
    net, counter, tokens = _prepared(spec, batch, s)
    fwd, bwd, opt_ops, step_ops = _step(net, counter, tokens, optimizer, "counts")
    net.zero_grad(set_to_none=True)
    reduction = count_grad_reduction(net, tokens)
    layers = [fwd.get(f"layer{i}", 0) + fwd.get(f"experts{i}", 0) for i in range(spec.layers)]
    experts = [fwd.get(f"experts{i}", 0) for i in range(spec.layers)]
    fwd_total = sum(fwd.values())
    ep = dict.fromkeys(data.DISPATCH_KEYS, 0)
    if spec.moe is not None and spec.moe.experts > 1:  # the smallest expert split; the count is the same at any
        ep = count_ep_dispatch(spec, min(d for d in range(2, spec.moe.experts + 1) if spec.moe.experts % d == 0),
                               batch * s)  # (tests/test_op_counts.py checks two degrees)
    return {"model": name, "optimizer": optimizer, "torch": torch.__version__, **ep,
            "experts": spec.moe.experts if spec.moe else 0,
            "fwd_embed": fwd.get("embed", 0), "fwd_layers": layers, "fwd_experts": experts,
            "fwd_head": fwd.get("head", 0) + fwd.get("untagged", 0), "fwd_total": fwd_total,
            "bwd_over_fwd": bwd / fwd_total, "optimizer_ops": opt_ops, "step_ops": step_ops, **reduction}


def bytes_at(spec: ModelSpec, optimizer: str, sequences: int) -> dict:
    """Bytes moved by the eager ops of one training step on `sequences` sequences of spec.seq_len tokens: forward
    by part (embed, layers, head), backward and optimizer totals (see the module docstring)."""
    net, counter, tokens = _prepared(spec, sequences, spec.seq_len, with_bytes=True)
    fwd, bwd, opt, _ = _step(net, counter, tokens, optimizer, "moved")
    return {"fwd_embed": fwd.get("embed", 0),
            "fwd_layers": [fwd.get(f"layer{i}", 0) + fwd.get(f"experts{i}", 0) for i in range(spec.layers)],
            "fwd_head": fwd.get("head", 0) + fwd.get("untagged", 0), "bwd": bwd, "optimizer": opt}


def count_bytes(model, optimizer: str = "muonh") -> dict:
    """Eager bytes of a model (preset name, YAML path or ModelSpec) as [fixed, per_sequence] pairs (two and three
    sequences counted), the optimizer's as one number (simulator.op_bytes reads them). Refuses a model over
    simulator.op_bytes.MAX_PARAMS parameters."""
    spec = model if isinstance(model, ModelSpec) else load_model(model)
    byte_data.check_countable(spec)
    at2, at3 = bytes_at(spec, optimizer, 2), bytes_at(spec, optimizer, 3)

    def split(a: int, b: int) -> list[int]:
        return [3 * a - 2 * b, b - a]  # bytes(n) = fixed + n x per_sequence through n = 2 and 3

    return {"model": spec.name, "optimizer": optimizer, "torch": torch.__version__, "seq_len": spec.seq_len,
            "fwd_embed": split(at2["fwd_embed"], at3["fwd_embed"]),
            "fwd_layers": [split(a, b) for a, b in zip(at2["fwd_layers"], at3["fwd_layers"])],
            "fwd_head": split(at2["fwd_head"], at3["fwd_head"]), "bwd": split(at2["bwd"], at3["bwd"]),
            "opt_step": at2["optimizer"]}


def host_seconds_per_op(model: str = "tiny-moe", optimizer: str = "muonh", seq: int = 8, samples: int = 5,
                        device: torch.device | None = None, clock=time.perf_counter) -> dict:
    """Host seconds per op of the backend's own op mix, forward, backward and optimizer apart: one training step of
    `model` on `seq` tokens, where the kernels' work is negligible, each part timed (the fastest of `samples`,
    rackcast.spread.undisturbed) and divided
    by the ops it makes. The three differ: a forward op also runs the module's Python code and records the autograd
    graph, a backward op is run by autograd's C++ engine, an optimizer op by the optimizer's per-tensor loop.
    `clock`: wall time by default; time.process_time on a CPU shared with other jobs counts only this process's own
    CPU seconds, not its waits for a core."""
    device = device or torch.device("cpu")
    spec = load_model(model)
    net = build_model(spec, seed=0, device=device)
    opt = build_optimizer(net, optimizer, lr=1e-3, adam_lr=1e-3 if optimizer == "muonh" else None)
    tokens = torch.randint(0, spec.vocab, (1, min(seq, spec.seq_len)), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    parts = ("forward", "backward", "optimizer")

    def step(counter: _Counter | None = None) -> list[float]:
        """One training step; the seconds of its forward, backward and optimizer parts (ops tagged by part)."""
        tags = counter.tags if counter else []
        marks = [clock()]
        with counter or contextlib.nullcontext():
            tags.append("forward")
            loss, _ = next_token_loss(net(tokens), tokens)
            sync()
            marks.append(clock())
            tags.append("backward")
            loss.backward()
            sync()
            marks.append(clock())
            tags.append("optimizer")
            opt.step()
            sync()
            marks.append(clock())
        opt.zero_grad(set_to_none=True)
        return [b - a for a, b in zip(marks, marks[1:])]

    for _ in range(2):
        step()
    counter = _Counter()
    step(counter)
    ops = {p: counter.counts.get(p, 0) for p in parts}
    times = [step() for _ in range(samples)]
    seconds = {p: undisturbed(t[i] for t in times) for i, p in enumerate(parts)}
    return {"model": spec.name, "tokens": int(tokens.numel()), "ops": ops, "seconds": seconds,
            "host_op_s": {p: seconds[p] / ops[p] for p in parts}}


OPTIMIZERS = ("muonh", "adamw")


def count_into_cache(model, optimizers: tuple[str, ...] = OPTIMIZERS) -> list[Path]:
    """Count a model (preset name, YAML path or ModelSpec) with each optimizer and write the counts into the op-count
    cache, where the simulator reads them (simulator.op_counts.store), and its eager bytes into the op-byte cache
    (simulator.op_bytes.store) where the model is small enough to count (simulator.op_bytes.countable); returns the
    files written."""
    spec = model if isinstance(model, ModelSpec) else load_model(model)
    files = [data.store(spec, opt, count_ops(spec, opt)) for opt in optimizers]
    if byte_data.countable(spec):
        files += [byte_data.store(spec, opt, count_bytes(spec, opt)) for opt in optimizers]
    return files


def write_count_table(models: list[str], optimizers: tuple[str, ...] = OPTIMIZERS, path: Path = data.TABLE_PATH,
                      progress: Callable[[str], None] | None = None,
                      bytes_path: Path = byte_data.TABLE_PATH) -> int:
    """Count every model (preset names or YAML paths) with each optimizer and write the simulator's packaged tables
    (simulator.op_counts.write_table; the eager bytes, simulator.op_bytes.write_table); models of one structure are
    counted once. Returns the entries written (counts and bytes)."""
    entries: dict[str, dict] = {}
    byte_entries: dict[str, dict] = {}
    for name in models:
        spec = load_model(name)
        for opt in optimizers:
            key, byte_key = data.cache_key(spec, opt), byte_data.cache_key(spec, opt)
            if key not in entries:
                if progress:
                    progress(f"{spec.name} ({opt})")
                entries[key] = count_ops(spec, opt)
            if byte_key not in byte_entries and byte_data.countable(spec):
                if progress:
                    progress(f"{spec.name} ({opt}) bytes")
                byte_entries[byte_key] = count_bytes(spec, opt)
    data.write_table(entries, torch.__version__, path)
    byte_data.write_table(byte_entries, torch.__version__, bytes_path)
    return len(entries) + len(byte_entries)
