"""What the trainer can run: the one definition the planner enumerates from and the trainer checks plans against.

`TRAINER` lists the parallel axes, recomputation modes, optimizer-state locations, pipeline schedules and plan
field values that rackcast.backend implements. The planner (planner.space) offers only layouts that pass
`refusals`, and the trainer (backend.parallel.validate_trainable, `rackcast train PLAN --check`) refuses a plan with
the same lines, one per reason, each naming the plan field. A feature joins `TRAINER` in the commit that implements
it in the backend, so the planner never recommends a layout the trainer cannot rehearse.

    from rackcast.capabilities import TRAINER, refusals
    refusals(plan, plan.model_spec())        # [] when the trainer can run the plan, else "field: reason" lines
"""

from __future__ import annotations

from dataclasses import dataclass

from rackcast.modelspec import ModelSpec
from rackcast.vocab import PLAN_SCHEDULES, PRECISIONS, SCHEDULES, SPLIT_BACKWARD_SCHEDULES, V_SHAPED_SCHEDULES



@dataclass(frozen=True)
class Capabilities:
    """The features one executor implements; a plan asking for anything else is refused (see `refusals`)."""

    fsdp: bool
    tensor: bool
    sequence_parallel: bool
    context: bool
    expert_tensor: bool
    recompute: tuple[str, ...]
    optimizer_state: tuple[str, ...]  # where optimizer state and master weights may live
    schedules: tuple[str, ...]
    zero_bubble_with_experts: bool  # zb_h1 / dualpipev together with expert parallelism
    zero_bubble_with_fsdp: bool  # zb_h1 / dualpipev together with fsdp > 1
    zb_h1_single_chunk: bool  # zb_h1 with virtual: 1
    tied_embeddings_pipeline: bool
    uneven_pipeline: bool  # parallel.stage_layers: chunks of different layer counts
    zero: tuple[int, ...]  # ZeRO stages of the data replicas (parallel.zero)
    zero_with_fsdp: bool  # parallel.zero >= 1 together with fsdp > 1
    mtp_pipeline: bool  # multi-token prediction modules with pipeline > 1
    precisions: tuple[str, ...]
    grad_dtypes: tuple[str, ...]
    master_weights: tuple[bool, ...]
    attention_kernels: tuple[str, ...]
    dropout: bool
    balanced_routing: bool  # expert_transport.routing: balanced forces the router's choices (rackcast.vocab)
    compile_processes: int  # largest process count a plan with compile: true may use (0: compile not implemented)
    tensor_with_experts: bool = True  # tensor > 1 together with expert > 1
    tensor_experts_with_pipeline: bool = True  # tensor > 1 and expert > 1 together with pipeline > 1
    tensor_with_context: bool = True  # tensor > 1 together with context > 1
    tensor_with_sharding: bool = True  # tensor > 1 together with fsdp > 1 or ZeRO
    tensor_with_offload: bool = True  # tensor > 1 with optimizer state in host memory
    tensor_model_variants: bool = True  # latent attention, sinks, MTP, per-layer KV heads, widths tensor does not split
    sequence_parallel_with_block_conv: bool = True  # conv.sites attn / mlp (causal over the sequence SP splits)
    context_with_fsdp: bool = True  # context > 1 together with fsdp > 1 (sharding over data x fsdp x context)
    context_with_pipeline: bool = True  # context > 1 together with pipeline > 1
    context_with_zero: bool = True  # context > 1 together with parallel.zero >= 1
    expert_tensor_with_tensor: bool = True  # expert_tensor > 1 together with tensor > 1
    expert_tensor_with_context: bool = True  # expert_tensor > 1 together with context > 1
    expert_tensor_with_fsdp: bool = True  # expert_tensor > 1 together with fsdp > 1
    expert_tensor_with_pipeline: bool = True  # expert_tensor > 1 together with pipeline > 1
    expert_tensor_with_zero: bool = True  # expert_tensor > 1 together with parallel.zero >= 1
    # tied embeddings or MTP (the last chunk reads the token embedding) with a V-shaped schedule (dualpipev), which
    # puts the first and the last chunk on one rank
    last_chunk_embedding_v_shaped: bool = True
    tied_mtp_split_backward: bool = True  # tied embeddings and MTP together under zb_h1 / dualpipev


# What rackcast.backend implements today (each flag is the backend module that does it).
TRAINER = Capabilities(
    fsdp=True,  # backend.fsdp (FSDP2)
    tensor=True,  # backend.tensor_parallel (DTensor column / row parallel attention and MLPs)
    sequence_parallel=True,  # backend.tensor_parallel (norms, router and routed experts on 1/tp of the sequence)
    context=True,  # backend.context_parallel (K/V all-gather, window halo, conv halo)
    expert_tensor=True,  # backend.expert_tensor (each routed expert's width split; one all-to-all over ep x etp)
    recompute=("none", "selective", "full"),  # backend.recompute
    optimizer_state=("hbm", "host"),  # backend.offload
    schedules=SCHEDULES,  # backend.pipeline runs each as its torch schedule class
    zero_bubble_with_experts=True,  # backend.pipeline: static stage shapes, no first-step shape inference
    zero_bubble_with_fsdp=True,  # backend.fsdp keeps the units gathered for their weight-gradient pass
    zb_h1_single_chunk=False,
    tied_embeddings_pipeline=True,  # backend.pipeline: the last stage's embedding copy, gradients summed with the first's
    uneven_pipeline=True,  # backend.pipeline builds each chunk from ParallelSpec.chunk_layer_range
    zero=(0, 1, 2),  # backend.zero: ZeRO-1 (optimizer state sharded over the replicas), ZeRO-2 (and gradients)
    zero_with_fsdp=False,
    mtp_pipeline=True,  # backend.pipeline: the MTP modules on the last chunk, with the embedding copy and the tokens
    precisions=("bf16", "fp32"),  # bf16: autocast on CUDA and CPU (backend.train)
    grad_dtypes=("fp32",),  # fp32 parameters, so fp32 gradients, reduced in fp32
    master_weights=(True,),  # the fp32 parameters are the master copy
    attention_kernels=("flash", "materialized"),  # fused SDPA, or SDPA's math backend (scores in memory)
    dropout=False,
    balanced_routing=True,  # backend.moe.balanced_assignment forces the choices; the router's scores weigh them
    compile_processes=1,  # backend.compiled: torch.compile on one-process plans (not tried with parallel layouts)
    # backend.parallel.Groups.expert_mesh folds the expert groups over the tp ranks (rackcast.layout's
    # expert_coordinates) and backend.expert_parallel dispatches each tp rank's tokens over them; with FSDP2
    # (backend.fsdp) and ZeRO (backend.zero) the expert gradients are divided by Layout.expert_divide too
    tensor_with_experts=True,
    tensor_experts_with_pipeline=True,  # backend.pipeline: static stage shapes under tp (the rank's sequence part with SP)
    tensor_with_context=False,  # not tried: tp and cp meshes are built apart (backend.parallel.Groups)
    tensor_with_sharding=True,  # backend.fsdp (FSDP2 over the tp DTensors, one root mesh) and backend.zero (owners per tp rank)
    tensor_with_offload=True,  # backend.offload (host copies of the tp DTensors on the CPU mesh; CUDA meshes refused there)
    tensor_model_variants=False,
    sequence_parallel_with_block_conv=False,
    context_with_fsdp=True,  # backend.parallel.dense_fsdp_mesh: sharded over fsdp, replicated over data x context
    context_with_zero=True,  # backend.zero over the token ranks (data x fsdp x context), divided by them
    context_with_pipeline=True,  # backend.train._pipeline_loss: stages on sequence chunks, the loss scaled per chunk
    expert_tensor_with_tensor=False,  # not tried: width slices in an expert group folded over the tp ranks
    expert_tensor_with_context=True,  # the width slices' gradients averaged over the token ranks data x context
    # backend.fsdp: the width slices' DTensors on the expert FSDP mesh's root (backend.parallel.Groups), sharded 2-D
    expert_tensor_with_fsdp=True,
    expert_tensor_with_pipeline=True,  # each stage's expert stacks sliced as without a pipeline
    expert_tensor_with_zero=True,  # backend.zero; ZeRO-2 sums the bias partials first (parallel.expert_tensor_presum)
    # the last chunk shares chunk 0's embedding without registering it; a split backward's weight pass
    # (stage_backward_weight) takes the stage's registered parameters only and drops that gradient (D2 dualpipev:
    # embedding 1.7e-2 off one process's after 5 steps)
    last_chunk_embedding_v_shaped=False,
    # one matrix as the head, the MTP head and the MTP embedding lookup of one chunk: torch 2.13's weight pass
    # backpropagates through a freed graph ("backward through the graph a second time")
    tied_mtp_split_backward=False,
)

# Everything the simulator and the estimate price: for hardware studies that plan beyond today's trainer.
EVERYTHING = Capabilities(
    fsdp=True, tensor=True, sequence_parallel=True, context=True, expert_tensor=True,
    recompute=("none", "selective", "full"), optimizer_state=("hbm", "host"),
    schedules=PLAN_SCHEDULES, zero_bubble_with_experts=True,
    zero_bubble_with_fsdp=True,
    zb_h1_single_chunk=True, tied_embeddings_pipeline=True, uneven_pipeline=True, zero=(0, 1, 2), zero_with_fsdp=True,
    mtp_pipeline=True, precisions=PRECISIONS,
    grad_dtypes=("bf16", "fp32"), master_weights=(True, False), attention_kernels=("flash", "materialized"),
    dropout=True, balanced_routing=True, compile_processes=2**31 - 1,
    expert_tensor_with_tensor=True, expert_tensor_with_context=True, expert_tensor_with_fsdp=True,
    expert_tensor_with_pipeline=True, expert_tensor_with_zero=True,
)


# What `rackcast plan --executor NAME` searches: the layouts the trainer runs, or every layout the simulator prices.
EXECUTORS = {"trainer": TRAINER, "any": EVERYTHING}

def refusals(plan, spec: ModelSpec, caps: Capabilities = TRAINER) -> list[str]:
    """Every reason the executor cannot run `plan`, one "field: reason" line each ([] when it can)."""
    p = plan.parallel
    out: list[str] = []
    axes = (("fsdp", p.fsdp > 1, caps.fsdp, "fully sharded data parallelism"),
            ("tensor", p.tensor > 1, caps.tensor, "tensor parallelism"),
            ("sequence_parallel", p.sequence_parallel, caps.sequence_parallel, "sequence parallelism"),
            ("context", p.context > 1, caps.context, "context parallelism"),
            ("expert_tensor", p.expert_tensor > 1, caps.expert_tensor, "expert tensor parallelism"))
    for name, asked, implemented, what in axes:
        if asked and not implemented:
            out.append(f"parallel.{name}: {what} is not implemented by the trainer")
    if p.tensor > 1:
        out += _tensor_refusals(plan, spec, caps)
    if p.context > 1:
        out.extend(_context_refusals(plan, spec, caps))
    if p.expert_tensor > 1 and caps.expert_tensor:
        out.extend(_expert_tensor_refusals(plan, caps))
    if p.pipeline > 1 and spec.tied_embeddings and not caps.tied_embeddings_pipeline:
        out.append("parallel.pipeline: tied embeddings across pipeline stages are not supported by the trainer")
    if p.pipeline > 1 and spec.mtp is not None and not caps.mtp_pipeline:
        out.append("parallel.pipeline: the trainer runs multi-token prediction (model mtp) after the head of an "
                   "unsplit model; use pipeline 1")
    if p.stage_layers and not caps.uneven_pipeline:
        out.append("parallel.stage_layers: uneven pipeline splits are not implemented by the trainer")
    if p.zero not in caps.zero:
        out.append(f"parallel.zero: ZeRO-{p.zero} is not implemented by the trainer (it runs ZeRO "
                   f"{' or '.join(map(str, caps.zero))})")
    elif p.zero > 0 and p.fsdp > 1 and not caps.zero_with_fsdp:
        out.append(f"parallel.zero: ZeRO-{p.zero} over data replicas that fsdp > 1 shards already is not "
                   "implemented by the trainer")
    if p.pipeline == 1 and p.virtual > 1:
        out.append("parallel.virtual: virtual stages need pipeline > 1")
    if p.pipeline > 1:
        if plan.schedule not in caps.schedules:
            out.append(f"schedule: {plan.schedule} is not implemented by the trainer")
        if plan.schedule in SPLIT_BACKWARD_SCHEDULES and p.expert > 1 and not caps.zero_bubble_with_experts:
            out.append(f"schedule: {plan.schedule} splits backward into input and weight parts, which the expert "
                       "all-to-all does not support; use 1f1b, gpipe or interleaved_1f1b with expert > 1")
        if plan.schedule in SPLIT_BACKWARD_SCHEDULES and p.fsdp > 1 and not caps.zero_bubble_with_fsdp:
            out.append(f"schedule: {plan.schedule} with fsdp > 1 does not train what one process trains in this "
                       "trainer; use 1f1b, gpipe or interleaved_1f1b with fsdp > 1")
        reads_embedding = spec.tied_embeddings or spec.mtp is not None
        if plan.schedule in V_SHAPED_SCHEDULES and reads_embedding and not caps.last_chunk_embedding_v_shaped:
            out.append(f"schedule: {plan.schedule} puts the first and the last chunk on one rank, where the trainer "
                       "loses the last chunk's embedding gradient (tied embeddings or model mtp); use 1f1b, "
                       "interleaved_1f1b or zb_h1")
        elif plan.schedule in SPLIT_BACKWARD_SCHEDULES and spec.tied_embeddings and spec.mtp is not None \
                and not caps.tied_mtp_split_backward:
            out.append(f"schedule: {plan.schedule} with tied embeddings and multi-token prediction (model mtp) "
                       "together is not implemented by the trainer; use 1f1b or interleaved_1f1b")
        if plan.schedule == "zb_h1" and p.virtual == 1 and not caps.zb_h1_single_chunk:
            out.append("parallel.virtual: zb_h1 runs as torch's ScheduleInterleavedZeroBubble, which needs "
                       "virtual >= 2")
    if plan.recompute not in caps.recompute:
        out.append(f"recompute: {plan.recompute} activation recomputation is not implemented by the trainer")
    if plan.optimizer.state_location not in caps.optimizer_state:
        out.append(f"optimizer.state_location: optimizer state in {plan.optimizer.state_location} memory is not "
                   "implemented by the trainer")
    if plan.precision not in caps.precisions:
        out.append(f"precision: {plan.precision} training is not implemented by the trainer "
                   f"(it runs {' or '.join(caps.precisions)})")
    if plan.grad_dtype not in caps.grad_dtypes:
        out.append(f"grad_dtype: {plan.grad_dtype} gradients are not implemented by the trainer "
                   f"(it keeps {' or '.join(caps.grad_dtypes)})")
    if plan.optimizer.master_weights not in caps.master_weights:
        out.append("optimizer.master_weights: training without an fp32 master copy is not implemented by the "
                   "trainer")
    if plan.attention_kernel not in caps.attention_kernels:
        out.append(f"attention_kernel: {plan.attention_kernel} is not implemented by the trainer")
    if plan.dropout and not caps.dropout:
        out.append("dropout: the trainer's model has no dropout layers")
    if plan.expert_transport.routing == "balanced" and spec.moe is not None and not caps.balanced_routing:
        out.append("expert_transport.routing: balanced (force-balanced benchmarking routing) is not implemented by "
                   "the trainer, whose router learns its choices; the estimate and simulator price it")
    if plan.compile and p.gpus > caps.compile_processes:
        out.append(f"compile: the trainer compiles one-process plans only ({p.gpus} processes here; torch.compile "
                   "with data, expert, fsdp or pipeline parallelism is not implemented); set compile: false")
    return out


def _tensor_refusals(plan, spec: ModelSpec, caps: Capabilities) -> list[str]:
    """What tensor > 1 cannot run with in this executor (see Capabilities' tensor_* flags)."""
    p, out = plan.parallel, []
    if p.expert > 1 and not caps.tensor_with_experts:
        out.append("parallel.tensor: tensor parallelism together with expert > 1 is not implemented by the trainer")
    elif p.expert > 1 and p.pipeline > 1 and not caps.tensor_experts_with_pipeline:
        out.append("parallel.tensor: tensor parallelism together with expert > 1 and pipeline > 1 is not "
                   "implemented by the trainer")
    if p.context > 1 and not caps.tensor_with_context:
        out.append("parallel.tensor: tensor parallelism together with context > 1 is not implemented by the trainer")
    if (p.fsdp > 1 or p.zero > 0) and not caps.tensor_with_sharding:
        out.append("parallel.tensor: tensor parallelism together with fsdp > 1 or ZeRO is not implemented by the "
                   "trainer")
    if plan.optimizer.state_location == "host" and not caps.tensor_with_offload:
        out.append("parallel.tensor: tensor parallelism with optimizer state in host memory is not implemented by "
                   "the trainer")
    if p.sequence_parallel and spec.conv is not None and {"attn", "mlp"} & set(spec.conv.sites) \
            and not caps.sequence_parallel_with_block_conv:
        out.append("parallel.sequence_parallel: short convolutions on the block outputs (conv.sites attn, mlp) "
                   "need the whole sequence, which sequence parallelism splits, in the trainer")
    if not caps.tensor_model_variants:
        a, t = spec.attention, p.tensor
        layers = range(spec.layers)
        if a.mla is not None or a.sinks or spec.mtp is not None:
            out.append("parallel.tensor: tensor parallelism of latent attention, attention sinks or multi-token "
                       "prediction is not implemented by the trainer")
        elif any(spec.kv_heads(i) != spec.kv_heads_stored(i) or spec.kv_heads(i) % t for i in layers):
            out.append(f"parallel.tensor: the trainer splits KV heads over the tensor ranks: every layer must attend "
                       f"with all its stored KV heads, a multiple of tensor={t}")
        widths = ([spec.ffn] if any(not spec.is_moe(i) for i in layers) else []) + \
            ([spec.moe.shared_ffn] if spec.moe is not None and spec.moe.shared_experts else [])
        if any(w % t for w in widths):
            out.append(f"parallel.tensor: MLP widths {widths} are not all divisible by tensor={t}")
    return out


# The other axes an axis may be refused together with: (Capabilities flag suffix, how a plan asks for it, its name).
def _combined_axes(p) -> tuple[tuple[str, bool, str], ...]:
    return (("tensor", p.tensor > 1, "tensor parallelism (parallel.tensor > 1)"),
            ("context", p.context > 1, "context parallelism (parallel.context > 1)"),
            ("fsdp", p.fsdp > 1, "fully sharded data parallelism (parallel.fsdp > 1)"),
            ("pipeline", p.pipeline > 1, "pipeline parallelism (parallel.pipeline > 1)"),
            ("zero", p.zero > 0, "ZeRO-sharded optimizer state (parallel.zero > 0)"))


def _combination_refusals(p, caps: Capabilities, axis: str, what: str) -> list[str]:
    """One line for each other axis the plan combines with `axis` where caps has `<axis>_with_<other>` False."""
    return [f"parallel.{axis}: {what} together with {other} is not implemented by the trainer"
            for name, asked, other in _combined_axes(p)
            if asked and not getattr(caps, f"{axis}_with_{name}", True)]


def _expert_tensor_refusals(plan, caps: Capabilities) -> list[str]:
    """What expert tensor parallelism (expert_tensor > 1) may not be combined with in this executor."""
    return _combination_refusals(plan.parallel, caps, "expert_tensor", "expert tensor parallelism")


def _context_refusals(plan, spec: ModelSpec, caps: Capabilities) -> list[str]:
    """What context parallelism (context > 1) may not be combined with in this executor."""
    p = plan.parallel
    # tensor with context is refused once, by _tensor_refusals (Capabilities has no context_with_tensor)
    out = _combination_refusals(p, caps, "context", "context parallelism")
    chunk = spec.seq_len // p.context
    # the last rank's chunk must hold the deepest MTP module's depth + 1 lookahead and one position with a target
    if spec.mtp is not None and chunk < spec.mtp.depth + 2:
        out.append(f"parallel.context: chunks of {chunk} tokens leave the last context rank no position with a "
                   f"target for multi-token prediction at depth {spec.mtp.depth} (it needs mtp.depth + 2 = "
                   f"{spec.mtp.depth + 2} tokens per chunk)")
    if spec.conv is not None and chunk < spec.conv.kernel - 1:
        out.append(f"parallel.context: chunks of {chunk} tokens are shorter than the short convolution's halo of "
                   f"{spec.conv.kernel - 1}")
    return out
