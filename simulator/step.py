"""Discrete-event simulation (SimPy) of one training step of a plan: `simulate(plan, seed) -> SimResult`.

One process per simulated rank class (a pipeline stage; data-parallel replicas and the ranks of a tensor / fsdp /
expert group are folded onto it, see simulator.stepnet) runs its pipeline schedule's action list
(simulator.schedules, the order torch.distributed.pipelining executes) as the ops of simulator.workload. Its
compute stream runs compute ops one at a time; communication ops run on their own streams (tensor, context,
expert, fsdp, data-parallel, expert-data-parallel, pipeline, host), in order within a stream and concurrently
across streams, as flows on the shared links. So the expert all-to-all overlaps the shared-expert compute, the
data-parallel gradient reduce-scatter / all-reduce overlaps the rest of the backward, pipeline sends overlap the
next micro-batch, and FSDP gathers are prefetched one layer ahead. A compute op that starts while a communication
op of its rank is running is slowed by the profile's comm_compute_slowdown (communication kernels take SMs).
With measured host times per op (efficiency.host_op_s) each compute task also spends its framework ops'
host time on the compute stream (simulator.workload, simulator.host_overhead); a slow stage then delays the others
through the schedule, so the overhead's pipeline bubble comes out of the simulation rather than a formula.

After its last backward a rank waits for its gradient reductions, then runs the optimizer: the state comes in
over the host link when it lives in host memory (NVLink-C2C on GB200), is updated, and goes back.

Phases (rackcast.vocab.PHASES names) are rank 0's timeline split by what it was doing: compute, or waiting for a given
communication, for another stage (pipeline_bubble) or for a transfer from it (pipeline_p2p); they sum to the step
time. Memory: allocation and release events give each rank's peak (static state, saved activations per layer and
micro-batch, FSDP gather and gradient buffers, the recomputed layer).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field

import simpy
from simpy.events import NORMAL, PENDING

from rackcast.errors import RackcastError
from rackcast.modelspec import FlopsConvention, ModelSpec
from rackcast.plan import PredictedBand, Plan, Predicted
from rackcast.simulator import costs, metrics
from rackcast.simulator.eventloop import Driven, Scheduled, StepEnvironment, new_event, run_to_end
from rackcast.simulator.ops import Comm, Compute, Host, Memory, Reduce, Start, Wait
from rackcast.simulator.schedules import pipeline_orders
from rackcast.simulator.stepnet import StepNetwork
from rackcast.simulator.workload import PerMicrobatch, StageWork, Workload
from rackcast.topologies.spec import Topology
from rackcast.vocab import PHASES


@dataclass
class Timeline:
    """What happened, for traces: slices (pid, thread, name, start_s, end_s), memory points per pid
    (time_s, bytes), link utilisation change points (time_s, link index, bytes/s), link names and capacities."""

    process_names: dict[int, str] = field(default_factory=dict)
    slices: list[tuple[int, str, str, float, float]] = field(default_factory=list)
    memory: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    links: list[str] = field(default_factory=list)
    link_capacity_Bps: list[float] = field(default_factory=list)
    utilisation: tuple = ((), (), ())


@dataclass
class SimResult:
    plan: str
    step_time_s: float
    tokens_per_s: float
    mfu: float
    phases_s: dict[str, float]
    drop_fraction: float
    peak_memory_bytes: float
    peak_memory_per_stage_bytes: list[float]
    events: int
    tokens_per_step: int
    model_flops_per_step: float
    days_to_budget: float
    flops_convention: str
    gpus: int
    simulated_ranks: int
    fits: bool
    seed: int
    reduced: bool
    band: dict = field(default_factory=dict)  # simulator.metrics.error_band (the stack profile's band)
    timeline: Timeline = field(default_factory=Timeline, repr=False, compare=False)

    def as_dict(self) -> dict:
        """The metrics (no timeline), with the key names of simulator.estimate.Estimate where they overlap."""
        return {k: v for k, v in vars(self).items() if k != "timeline"}

    def to_predicted(self) -> Predicted:
        return Predicted(source="simulate", step_time_s=self.step_time_s, tokens_per_s=self.tokens_per_s,
                         mfu=self.mfu, peak_memory_bytes=self.peak_memory_bytes,
                         days_to_budget=self.days_to_budget, phases_s=dict(self.phases_s),
                         flops_convention=self.flops_convention, drop_fraction=self.drop_fraction, fits=self.fits,
                         band=PredictedBand.of(self.band))


class _Rank:
    """One simulated rank class: its compute stream, communication streams, memory and phase accounting."""

    def __init__(self, sim: "_StepSim", stage: int):
        self.sim, self.env, self.stage = sim, sim.env, stage
        self.work: StageWork = sim.work.stages[stage]
        self.tails: dict[str, simpy.Event] = {}
        self.active = 0
        self.mem = self.peak = 0.0
        self.mem_points: list[tuple[float, float]] = []
        self.phases: dict[str, float] = defaultdict(float)
        self.pending: list[simpy.Event] = []
        self.finish = 0.0

    # ------------------------------------------------------------------------------------------------ memory
    def alloc(self, nbytes: float) -> None:
        self.mem += nbytes
        if self.mem > self.peak:
            self.peak = self.mem
        if self.sim.record:
            self.mem_points.append((self.env.now, self.mem))

    # ------------------------------------------------------------------------------------------ communication
    def start(self, comm: Comm) -> simpy.Event:
        """Start `comm` after the previous op of its stream; the returned event succeeds (value: the time) when it
        ends. Run as callbacks (_CommRun), with the events a SimPy process would schedule, in the same order."""
        run = _CommRun(self, comm, self.tails.get(comm.stream))
        self.tails[comm.stream] = run.end
        self.env.start_soon(run.begin)
        return run.end

    # --------------------------------------------------------------------------------------------------- ops
    def run(self, ops, handles: dict):
        """Run a list of simulator.ops records (see that module for what each kind does)."""
        env, slow, record, phases = self.env, self.sim.slowdown, self.sim.record, self.phases
        timeout, slices = env.timeout, self.sim.timeline.slices
        queue, eid, push, new_scheduled = env._queue, env._eid, heapq.heappush, Scheduled.__new__
        for op in ops:
            kind = type(op)
            if kind is Compute:
                d = op.seconds
                if d <= 0.0:
                    continue
                if self.active and slow:
                    d *= 1.0 + slow
                t0 = env._now
                ev = new_scheduled(Scheduled)  # env.timeout(d)'s queue entry (eventloop.call_later, inlined)
                ev.callbacks, ev._ok, ev._value = [], True, None
                push(queue, (t0 + d, NORMAL, next(eid), ev))
                yield ev
                phases["compute"] += d
                if record:
                    slices.append((self.stage, "compute", op.name, t0, env._now))
            elif kind is Memory:  # the most frequent kind after Compute; as alloc()
                mem = self.mem = self.mem + op.nbytes
                if mem > self.peak:
                    self.peak = mem
                if record:
                    self.mem_points.append((env._now, mem))
            elif kind is Host:
                t0 = env._now
                yield timeout(op.seconds)
                phases["compute"] += op.seconds
                if record:
                    slices.append((self.stage, "compute", op.name, t0, env._now))
            elif kind is Start:
                handles[op.key] = self.start(op.comm)
            elif kind is Wait:
                ev = handles.pop(op.key)
                if ev._value is PENDING:  # not triggered
                    t0 = env._now
                    yield ev
                    phases[op.phase] += env._now - t0
            elif kind is Reduce:
                self.pending.append(self.start(op.comm))
            else:
                raise TypeError(f"unknown op record {op!r} (simulator.ops)")

    def wait_dep(self, key):
        """Wait for an input from another chunk: bubble while its producer computes, p2p while it travels."""
        sim, env = self.sim, self.env
        done, arrive = sim.event(("done",) + key), sim.event(("arrive",) + key)
        if not done.triggered:
            t0 = env.now
            yield done
            self.phases["pipeline_bubble"] += env.now - t0
        if not arrive.triggered:
            t0 = env.now
            yield arrive
            self.phases["pipeline_p2p"] += env.now - t0

    def process(self, order):
        sim, env, work = self.sim, self.env, self.work
        self.alloc(sum(work.static_bytes.values()) + work.io_bytes)
        last_chunk = sim.work.n_chunks - 1
        last_grad = {}
        for idx, a in enumerate(order):
            if a.kind in ("BW", "W"):
                last_grad[a.stage] = idx
        final = max(last_grad.values()) if last_grad else -1
        for idx, a in enumerate(order):
            c, i = a.stage, a.microbatch
            if a.kind == "F" and c > 0:
                yield from self.wait_dep(("F", c - 1, i))
            elif a.kind in ("B", "BW") and c < last_chunk:
                yield from self.wait_dep(("G", c + 1, i))
            overlap = sim.plan.overlap_grad_reduce
            # ZeRO-2 keeps only its shard of the gradients: every micro-batch's backward reduces its layers'
            # gradients as they come (in the background), not only the last one's.
            each = sim.plan.parallel.zero >= 2 and a.kind in ("BW", "W") and last_grad.get(c) != idx
            ops = sim.chunk_ops(work, a, reduce=each or (overlap and last_grad.get(c) == idx), top=idx == final)
            yield from self.run(ops, {})
            if a.kind != "W":
                key = ("F" if a.kind == "F" else "G", c, i)
                sim.event(("done",) + key).succeed(env.now)
                dst = c + 1 if a.kind == "F" else c - 1
                if 0 <= dst <= last_chunk and sim.work.chunk_rank[dst] != self.stage:
                    comm = Comm("p2p", str(sim.work.chunk_rank[dst]), sim.p2p_bytes, "pp",
                                "send activations" if a.kind == "F" else "send gradients")
                    self.start(comm).callbacks.append(lambda _e, k=key: sim.event(("arrive",) + k).succeed())
                else:
                    sim.event(("arrive",) + key).succeed()
        t0 = env.now
        if not sim.plan.overlap_grad_reduce:  # after the backward, one collective at a time, blocking
            for comm in work.reduction_comms:
                yield self.start(comm)
        if self.pending:
            yield env.all_of(self.pending)
        self.phases["exposed_dp_comm"] += env.now - t0
        host = work.host_bytes
        for comm, phase in ((Comm("from_host", "host", host, "host", "optimizer state in"), "host_transfer"),
                            (None, "optimizer"),
                            (Comm("to_host", "host", host, "host", "optimizer state out"), "host_transfer")):
            t0 = env.now
            if comm is None:
                yield env.timeout(work.optimizer_s)
                if sim.record:
                    sim.timeline.slices.append((self.stage, "compute", "optimizer step", t0, env.now))
            elif host > 0:
                yield self.start(comm)
            self.phases[phase] += env.now - t0
        t0 = env.now
        for comm in work.gather_comms or ():  # ZeRO-1/2: the updated weights, one collective at a time
            yield self.start(comm)
        self.phases["exposed_dp_comm"] += env.now - t0
        self.finish = env.now


class _CommRun(Driven):
    """One communication op of a rank as callbacks rather than a SimPy process (no generator of its own to resume
    per event): it waits for the previous op of its stream, counts as active on its rank while it runs the network
    generator of simulator.stepnet, records its slice and triggers `end` (value: the time), each at the moment the
    process did."""

    __slots__ = ("rank", "comm", "prev", "t0")

    def __init__(self, rank: _Rank, comm: Comm, prev):
        env = self.env = rank.env  # Driven.__init__, without the super() call (one per communication op)
        self.generator, self.end = None, new_event(env)
        self.rank, self.comm, self.prev = rank, comm, prev
        self.t0 = 0.0

    def begin(self, _event) -> None:
        prev = self.prev
        if prev is not None and prev._value is PENDING:  # not triggered
            prev.callbacks.append(self.run)
        else:
            self.run(None)

    def run(self, _event) -> None:
        rank = self.rank
        rank.active += 1
        self.t0 = rank.env._now
        self.generator = rank.sim.run_comm(rank.stage, self.comm)
        self.resume(None)

    def finish(self, value=None) -> None:
        rank = self.rank
        rank.active -= 1
        sim, now = rank.sim, rank.env._now
        if sim.record:
            sim.timeline.slices.append((rank.stage, sim.thread(self.comm), self.comm.name, self.t0, now))
        Driven.finish(self, now)


class _StepSim:
    def __init__(self, plan: Plan, spec: ModelSpec, topo: Topology, seed: int, reduce: bool, record: bool):
        self.plan, self.spec, self.topo = plan, spec, topo
        self.env = StepEnvironment()
        self.record = record
        self.work = Workload(spec, plan, topo, seed)
        self.net = StepNetwork(self.env, plan, topo, reduce=reduce, track_utilisation=record)
        self.slowdown = topo.efficiency.comm_compute_slowdown
        self.p2p_bytes = costs.pipeline_bytes(self.work.tokens_mb, spec)
        self.timeline = Timeline()
        self._events: dict = {}
        self._cats = {}
        self._a2a: dict = {}
        self._templates: dict[tuple, tuple] = {}  # chunk_ops's templates

    def event(self, key) -> simpy.Event:
        ev = self._events.get(key)
        if ev is None:
            ev = self._events[key] = self.env.event()
        return ev

    def thread(self, comm: Comm) -> str:
        if comm.kind in ("to_host", "from_host"):
            return "host link"
        if comm.kind == "p2p":
            span = self.net.group("pipeline").span
        else:
            span = self.net.group(comm.axis).span
        return f"{'nvlink' if span == 'scale_up' else 'nic'} {comm.stream}"

    def run_comm(self, stage: int, comm: Comm):
        """The generator that runs `comm` on the network (returned, not delegated to: one frame less per resume)."""
        net, k = self.net, comm.kind
        if k in ("all_reduce", "reduce_scatter", "all_gather"):
            return net.ring(stage, comm.axis, k, comm.nbytes, tag=comm.name)
        if k == "all_to_all":
            key = (stage, comm.a2a, comm.nbytes)
            if key in self._a2a:  # the backward (and a recompute) repeats the forward's exchange: same draw, bytes
                flows = self._a2a[key]
            else:
                cats = self._cats.get(stage)
                if cats is None:
                    cats = self._cats[stage] = net.a2a_categories(stage)
                layer, mb, direction = comm.a2a
                send, recv = self.work.loads.port_bytes(layer, mb, direction, cats)
                flows = self._a2a[key] = net.a2a_flows(stage, send, recv, comm.nbytes)
            return net.run_a2a(flows, tag=comm.name, lead_s=comm.lead_s)
        if k == "shift":
            return net.shift(stage, comm.axis, comm.nbytes, tag=comm.name)
        if k == "p2p":
            return net.p2p(stage, int(comm.axis), comm.nbytes, tag=comm.name)
        return net.host(stage, comm.nbytes, to_host=k == "to_host", tag=comm.name)

    # ------------------------------------------------------------------------------------------ chunk programs
    def chunk_ops(self, st: StageWork, a, reduce: bool, top: bool) -> list:
        """The ops of one schedule action (F, B, W or BW of one chunk and micro-batch) on stage `st`: its kind's
        template (built once) with the ops that depend on the micro-batch filled in."""
        key = (st.stage, a.stage, a.kind, reduce, top)
        template = self._templates.get(key)
        if template is None:
            ops = self._chunk_template(st, a, reduce, top)
            template = self._templates[key] = (ops, [(i, op.make) for i, op in enumerate(ops)
                                                     if type(op) is PerMicrobatch])
        ops, per_mb = template
        if per_mb:  # else the template itself: run() only reads it
            ops = ops.copy()
            for i, make in per_mb:
                ops[i] = make(a.microbatch)
        return ops

    def _chunk_template(self, st: StageWork, a, reduce: bool, top: bool) -> list:
        """chunk_ops with PerMicrobatch records where an op depends on a.microbatch."""
        wl, plan = self.work, self.plan
        hc = wl.host_costs  # host ops and eager bytes (simulator.host_overhead.HostCosts)
        layers = st.chunks[a.stage]
        last = a.stage == wl.n_chunks - 1
        rc = plan.recompute
        mb = None
        ops: list = []
        seq = layers if a.kind == "F" else layers[::-1]
        gathers = [wl.gather_comms(lw) for lw in seq] if a.kind in ("F", "BW", "B") else [[] for _ in seq]
        ends = ((st.embed_params if a.stage == 0 else 0.0) + (st.head_params if last else 0.0)
                if a.kind in ("F", "BW", "B") else 0.0)
        top_gather = wl.top_gather(ends)
        for comm, nbytes in top_gather:
            ops += [Memory(nbytes), Start("top", comm), Wait("top", "exposed_fsdp_gather")]
        if a.kind != "F" and last:
            if st.head_ops > 0.0:
                ops.append(Host("head and loss backward host ops",
                                hc.backward_s(st.head_ops, a.kind, st.head_bytes)))
            ops.append(Compute("head and loss backward", (2.0 if a.kind == "BW" else 1.0) * st.head_s))
            ops += wl.mtp_context(backward=True) if a.kind != "W" else []
        if a.kind == "F" and a.stage == 0:
            if st.embed_ops > 0.0:
                ops.append(Host("embedding host ops", hc.forward_s(st.embed_ops, st.embed_bytes)))
            ops.append(Compute("embedding", st.embed_s))

        def start_gather(j):
            for n, (comm, nbytes) in enumerate(gathers[j]):
                ops.append(Memory(nbytes))
                ops.append(Start(f"ag{j}.{n}", comm))

        for j, lw in enumerate(seq):
            key = f"{lw.index}."
            if j == 0:
                start_gather(0)
            if j + 1 < len(seq):
                start_gather(j + 1)  # prefetch the next layer's parameters
            for n in range(len(gathers[j])):
                ops.append(Wait(f"ag{j}.{n}", "exposed_fsdp_gather"))
            if a.kind == "F":
                ops += wl.layer_forward(lw, mb, key)
                ops.append(Memory(lw.kept_bytes if rc == "full" else lw.act_bytes - (lw.core_bytes if rc == "selective"
                                                                                    else 0.0)))
            else:
                grad_buf = wl.grad_buffer_bytes(lw) if a.kind == "BW" else 0.0
                ops.append(Memory(grad_buf))
                if a.kind != "W" and rc == "full":
                    ops.append(Memory(lw.act_bytes))
                    ops += wl.layer_forward(lw, mb, key + "r", recompute=True)
                elif a.kind != "W" and rc == "selective":
                    ops += wl.selective_recompute(lw)
                ops += wl.layer_backward(lw, mb, key, a.kind)
                if a.kind != "W":
                    saved = lw.act_bytes + lw.kept_bytes if rc == "full" else \
                        lw.act_bytes - (lw.core_bytes if rc == "selective" else 0.0)
                    ops.append(Memory(-saved))
                ops.append(Memory(-grad_buf))
                if reduce:
                    ops += [Reduce(comm) for comm in wl.reduction_comms(lw.dense_params, lw.expert_params)]
            ops += [Memory(-nbytes) for _, nbytes in gathers[j]]
        if a.kind == "F" and last:
            if st.head_ops > 0.0:
                ops.append(Host("head and loss host ops", hc.forward_s(st.head_ops, st.head_bytes)))
            ops += wl.mtp_context(backward=False)
            ops.append(Compute("head and loss", st.head_s))
        if a.kind != "F" and a.stage == 0:
            ops.append(Compute("embedding backward", (2.0 if a.kind == "BW" else 1.0) * st.embed_s))
            if st.embed_ops > 0.0:
                ops.append(Host("embedding backward host ops",
                                hc.backward_s(st.embed_ops, a.kind, st.embed_bytes)))
        ops += [Memory(-nbytes) for _, nbytes in top_gather]
        if reduce and top and st.top_params > 0:
            ops += [Reduce(comm) for comm in wl.reduction_comms(st.top_params, 0.0)]
        return ops

    # ------------------------------------------------------------------------------------------------- run
    def run(self) -> tuple[list[_Rank], int]:
        par = self.plan.parallel
        orders = pipeline_orders(self.plan.schedule, par.pipeline, self.plan.microbatches, par.chunks_per_rank)
        ranks = [_Rank(self, s) for s in range(par.pipeline)]
        for r, order in zip(ranks, orders):
            self.env.drive(r.process(order))
        return ranks, run_to_end(self.env)


# Work bounds, checked before a simulation starts (simulate's cost grows with the step it simulates): about 40-100
# events per layer and micro-batch at ~40k events/s keeps a step under a minute or two; the routing draws are one
# float64 array of micro-batches x MoE layers x expert ranks x (experts, or expert ranks when dropless).
MAX_LAYER_PASSES = 2**15
MAX_ROUTING_VALUES = 2**24


def check_work(plan: Plan, spec: ModelSpec) -> None:
    """Refuse (one line naming the field) a step too large to simulate in bounded time and memory."""
    m = plan.microbatches
    passes = m * spec.layers
    if passes > MAX_LAYER_PASSES:
        raise RackcastError(f"batch.global_batch: {m:,} micro-batches x {spec.layers} layers = {passes:,} layer passes "
                            f"per step; simulate runs at most {MAX_LAYER_PASSES:,} (raise batch.micro_batch or lower "
                            "batch.global_batch)")
    if spec.moe is not None:
        ep = plan.parallel.expert
        width = spec.moe.experts if plan.expert_transport.mode == "capacity" else ep
        values = m * spec.layers * ep * width
        if values > MAX_ROUTING_VALUES:
            raise RackcastError(f"parallel.expert: routing draws of {m:,} micro-batches x {spec.layers} layers x "
                                f"{ep} expert ranks x {width} = {values:,} values; simulate draws at most "
                                f"{MAX_ROUTING_VALUES:,}")


def simulate(plan: Plan, seed: int = 0, spec: ModelSpec | None = None, topo: Topology | None = None, *,
             convention: FlopsConvention = FlopsConvention(), reduce: bool = True, record: bool = True) -> SimResult:
    """Simulate one training step of `plan` (see the module docstring). reduce=False simulates every GPU's
    traffic on the full cluster graph (slow; for checking the symmetry reduction). record=False skips the
    timeline (faster; the metrics are the same)."""
    spec = spec or plan.model_spec()
    check_work(plan, spec)
    topo = topo or plan.topology_spec()
    sim = _StepSim(plan, spec, topo, seed, reduce, record)
    ranks, events = sim.run()
    step = max(r.finish for r in ranks)
    phases = {k: 0.0 for k in PHASES}
    for k, v in ranks[0].phases.items():
        phases[k] = phases.get(k, 0.0) + v
    phases["pipeline_bubble"] += step - ranks[0].finish
    tokens = plan.tokens_per_step(spec)
    model_flops = metrics.model_flops_per_step(spec, tokens, convention)
    peaks = [r.peak for r in ranks]
    fits = bool(metrics.fits_memory(max(peaks), ranks[0].work.host_bytes, topo))
    if record:
        tl = sim.timeline
        for r in ranks:
            tl.process_names[r.stage] = (f"stage {r.stage} (GPU {sim.net.name(sim.net.rep(r.stage))}; stands for "
                                         f"{plan.parallel.stage_ranks} GPUs)")
            tl.memory[r.stage] = r.mem_points
        tl.links = [f"{u}->{v}" for u, v in sim.net.net.links]
        tl.link_capacity_Bps = [float(c) for c in sim.net.net.capacity]
        tl.utilisation = sim.net.net.utilisation_arrays()
    rate = metrics.step_metrics(tokens, step, model_flops, topo.gpus, topo, plan.tokens)
    return SimResult(
        plan=plan.name, step_time_s=step, tokens_per_s=rate.tokens_per_s, mfu=rate.mfu, phases_s=phases,
        drop_fraction=sim.work.loads.drop_fraction if sim.work.loads else 0.0,
        peak_memory_bytes=max(peaks), peak_memory_per_stage_bytes=peaks, events=events, tokens_per_step=tokens,
        model_flops_per_step=model_flops,
        days_to_budget=rate.days_to_budget,
        flops_convention=convention.label, gpus=topo.gpus, simulated_ranks=len(ranks), fits=fits, seed=seed,
        reduced=reduce, band=metrics.error_band(step, rate.mfu, rate.days_to_budget, topo), timeline=sim.timeline)
