"""Latent mixture-of-experts layer (Marin 535B-A23B's MoE block) with a seam for expert parallelism.

Forward, per token x (full width d_model):
1. route: fp32 router logits s = x W_r; choose the top K of s + b (b: the balancing bias, a stored parameter with no
   gradient, set by backend.balancing.QuantileBalancer); the (K+1)-th biased value is the token's quantile-balancing
   threshold a_t, and the margins s - a_t are kept for the balancer when it is attached. Combine weights are
   sigmoid of the chosen *unbiased* logits, renormalised to sum to `combine_sum` per token. We default to 1.0 (a
   convex combination of expert outputs); Marin renormalises to the constant 2.5 (_ROUTING_RENORM_SUM, DeepSeek-V3's
   routed scaling factor): pass combine_sum=2.5 to reproduce it.
2. latent: the routed experts see RMSNorm(x W_down) (latent width, the RMSNorm has a gain); the weighted sum of
   their outputs is projected back with W_up (LatentMoE, arXiv 2601.18089). Without latent_dim they see x.
3. `dispatch_compute_combine(tokens, expert_ids, weights)`: the seam. The default runs every expert locally: sort
   the (token, expert) assignments by expert once (argsort; counts by bincount), run the experts over their
   contiguous slices as grouped GEMMs (GroupedExperts), scale by the combine weight and scatter back per token with
   one index_add. An expert-parallel subclass overrides only this method
   (all_to_all_single the sorted rows with `counts` as split sizes, run its slice of GroupedExperts, send back) and
   reuses `sort_by_expert` / `combine`. Expert weights are stacked [E, ...] so a rank can own experts[e0:e1].
4. shared experts: dense SwiGLU MLPs at full width applied to every token, added to the routed output.

Force-balanced routing (the plan's expert_transport.routing: balanced, set by backend.train as `balanced_routing`):
the router still scores every token, but the chosen experts are `balanced_assignment`'s, token t's k-th choice
expert (t K + k) mod E (t: the token's index in the forward's flattened batch), so each forward gives every expert
T K / E assignments (to within one when E does not divide T K), as throughput benchmarks force it; the combine
weights are still the sigmoid of the router's logits at those experts, so the router gets a gradient. When E
divides seq_len K each whole sequence is balanced on its own, and the choice does not depend on how the batch is
split into micro-batches or ranks. The balancing statistics (margins, counts) are computed as without it.

Each forward records tokens per expert (`last_routing_counts`, and `routing_counts_sum` until reset) for logging.

Frontier routing (backend.frontier_routing), chosen by the ModelSpec: a learned router bias (GPT-OSS: added to the
logits, with a gradient) when the balancing method does not set it; node-limited top-k (moe.node_limit); the
auxiliary load-balancing loss (balancing: aux_loss), attached to the layer's output (backend.attached_loss); the
auxiliary-loss-free bias (balancing: aux_free_bias), stepped by frontier_routing.AuxFreeBiasBalancer from
`step_counts`.

    .venv/bin/pytest -q tests/test_backend_model.py -k moe
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rackcast.backend.attached_loss import AttachedLoss
from rackcast.backend.context_parallel import sum_over_context, sum_over_sequence_shards
from rackcast.backend.frontier_routing import group_limited, switch_aux_loss
from rackcast.backend.layers import Mlp, Normal, RMSNorm
from rackcast.modelspec import ModelSpec
from rackcast.simulator.op_counts import GROUPED_MM_ALIGN_BYTES


def balanced_assignment(tokens: int, top_k: int, experts: int, device=None) -> Tensor:
    """Force-balanced expert ids [tokens, top_k]: token t's k-th choice is expert (t top_k + k) mod experts (distinct
    per token while top_k <= experts). The ids are a slice of a [tokens, top_k + 1] tensor, as the router's own
    top-(K+1) slice is, so what consumes them runs the same ops (backend.opcount counts them)."""
    ids = (torch.arange(tokens * (top_k + 1), device=device).view(tokens, top_k + 1)
           - torch.arange(tokens, device=device)[:, None]) % experts
    return ids[:, :top_k]  # row t: t K .. t K + K - 1 (mod E)


class Router(nn.Module):
    """Router weight [E, d_model] and the balancing bias [E] (an nn.Parameter with requires_grad=False: ModelSpec
    counts it as a parameter, but it is set by quantile balancing, never by gradient)."""

    OPTIM_GROUP = "adam"

    def __init__(self, d_model: int, experts: int, bias: bool, learned_bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, d_model))
        self.bias = nn.Parameter(torch.empty(experts), requires_grad=learned_bias) if bias else None
        self.learned_bias = bias and learned_bias

    def init_weights(self, normal: Normal) -> None:
        normal(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        # Logits in fp32 even under autocast (Marin keeps the router path in fp32 before top-k and QB statistics).
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(x.float(), self.weight.float(), self.bias.float() if self.learned_bias else None)


def _pad_to_alignment(t: Tensor, dims: tuple[int, ...]) -> Tensor:
    """Zero-pad `dims` of t so their length in bytes is a multiple of GROUPED_MM_ALIGN_BYTES (exact: the padded
    rows and columns multiply by zeros); t itself when already aligned."""
    unit = max(1, GROUPED_MM_ALIGN_BYTES // t.element_size())
    pad = [0] * (2 * t.ndim)
    for dim in dims:
        pad[2 * (t.ndim - 1 - dim % t.ndim) + 1] = -t.shape[dim] % unit
    return F.pad(t, pad) if any(pad) else t


def grouped_matmul(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """Rows offs[e-1]..offs[e] of x [n, k] times w[e] [k, m] for every e, as one torch grouped_mm -> [n, m].

    Computes in x's dtype (under autocast: the autocast dtype; grouped_mm is not on autocast's lists). Widths whose
    rows are not a multiple of 16 bytes (structural twins, odd presets) are zero-padded first. grouped_mm's backward
    needs a contiguous incoming gradient, so a hook makes it one.
    """
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    k, m = w.shape[-2:]
    xa = _pad_to_alignment(x.to(dtype), (1,))
    wa = _pad_to_alignment(w.to(dtype), (1, 2))
    y = F.grouped_mm(xa, wa, offs=offs)
    if y.requires_grad:
        y.register_hook(Tensor.contiguous)
    return y[:, :m] if wa.shape[-1] != m else y


WEIGHT_NAMES = ("w_gate_up", "w_up", "w_down", "b_gate_up", "b_up", "b_down")  # GroupedExperts' parameters


class GroupedExperts(nn.Module):
    """E routed experts as stacked tensors: SwiGLU's gate and up fused, w_gate_up [E, dim, 2 width] (gate columns
    first), else w_up [E, dim, width]; w_down [E, width, dim] (+ biases [E, .]).

    forward(x_sorted, counts) runs expert e on rows sum(counts[:e]) .. sum(counts[:e+1]) of x_sorted: each of the
    MLP's matrices is one grouped GEMM over all experts (torch.nn.functional.grouped_mm with cumulative offsets;
    empty experts are empty groups), as torchtitan's GroupedExperts; the gate and up projections are one grouped GEMM
    over the fused matrix. `matrix_parts` tells MuonH to treat gate and up as separate matrices (per expert), and
    init_weights draws them in that order, as with separate stacks. len(counts) must equal the number of experts
    this module holds, so an expert-parallel rank can hold a slice. `reference_forward` is the per-expert Python
    loop with separate gate and up matmuls, kept as the test oracle.
    """

    OPTIM_GROUPS = {"b_gate_up": "adam", "b_up": "adam", "b_down": "adam"}  # biases are 2-D here; not matrices

    def __init__(self, experts: int, dim: int, width: int, activation: str, bias: bool):
        super().__init__()
        self.activation = activation
        self.width = width
        swiglu = activation == "swiglu"
        self.w_gate_up = nn.Parameter(torch.empty(experts, dim, 2 * width)) if swiglu else None
        self.w_up = nn.Parameter(torch.empty(experts, dim, width)) if not swiglu else None
        self.w_down = nn.Parameter(torch.empty(experts, width, dim))
        self.b_gate_up = nn.Parameter(torch.empty(experts, 2 * width)) if bias and swiglu else None
        self.b_up = nn.Parameter(torch.empty(experts, width)) if bias and not swiglu else None
        self.b_down = nn.Parameter(torch.empty(experts, dim)) if bias else None
        self.matrix_parts = {"w_gate_up": (-1, (width, width))} if swiglu else {}

    @property
    def num_experts(self) -> int:
        return self.w_down.shape[0]

    def init_weights(self, normal: Normal) -> None:
        with torch.no_grad():
            for name, p in self.named_parameters(recurse=False):
                if not name.startswith("w_"):
                    nn.init.zeros_(p)
                    continue
                dim, sizes = self.matrix_parts.get(name, (-1, (p.shape[-1],)))
                for part in p.split(sizes, dim):  # each part drawn whole, in order, then copied into its columns
                    drawn = torch.empty(part.shape, dtype=p.dtype, device=p.device)
                    normal(drawn)
                    part.copy_(drawn)

    def local_weights(self) -> dict[str, Tensor | None]:
        """The tensors forward computes with, by parameter name (None where absent): the parameters themselves here;
        an expert-tensor-parallel slice gives its local shards (backend.expert_tensor)."""
        return {name: getattr(self, name) for name in WEIGHT_NAMES}

    def _in_weights(self) -> Tensor:
        return self.w_gate_up if self.w_gate_up is not None else self.w_up

    def _in_bias(self) -> Tensor | None:
        return self.b_gate_up if self.w_gate_up is not None else self.b_up

    def _check(self, counts) -> Tensor:
        counts = torch.as_tensor(counts)
        if counts.numel() != self.num_experts:
            raise ValueError(f"counts has {counts.numel()} entries for {self.num_experts} experts")
        return counts

    def forward(self, x_sorted: Tensor, counts: Tensor | list[int]) -> Tensor:
        counts = self._check(counts).to(x_sorted.device)
        w = self.local_weights()
        if x_sorted.shape[0] == 0:  # no rows here: keep every expert weight in the graph so gradients exist (zeros)
            anchor = sum(t.sum() for t in w.values() if t is not None) * 0.0
            return x_sorted.new_zeros(0, w["w_down"].shape[-1]) + anchor
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        row_expert = None
        swiglu = w["w_gate_up"] is not None
        if w["b_down"] is not None:  # per-expert biases: each row gathers its expert's
            row_expert = torch.repeat_interleave(torch.arange(self.num_experts, device=counts.device), counts,
                                                 output_size=x_sorted.shape[0])
        h = grouped_matmul(x_sorted, w["w_gate_up"] if swiglu else w["w_up"], offs)
        if row_expert is not None:
            h = h + (w["b_gate_up"] if swiglu else w["b_up"])[row_expert]
        if swiglu:
            gate, up = h.split(self.width, -1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        y = grouped_matmul(h, w["w_down"], offs)
        return y + w["b_down"][row_expert] if row_expert is not None else y

    # ------------------------------------------------------------------------------------------------ oracle
    def _expert(self, e: int, x: Tensor) -> Tensor:
        w_in, b_in = self._in_weights()[e], self._in_bias()
        if self.w_gate_up is not None:  # separate gate and up matmuls
            w_gate, w_up = w_in.split(self.width, -1)
            gate, up = x @ w_gate, x @ w_up
            if b_in is not None:
                b_gate, b_up = b_in[e].split(self.width)
                gate, up = gate + b_gate, up + b_up
            h = F.silu(gate) * up
        else:
            up = x @ w_in
            h = F.gelu(up + b_in[e] if b_in is not None else up)
        y = h @ self.w_down[e]
        return y + self.b_down[e] if self.b_down is not None else y

    def reference_forward(self, x_sorted: Tensor, counts: Tensor | list[int]) -> Tensor:
        """The same function as forward, one expert at a time in a Python loop (the test oracle; slow: each w[e]
        index's backward materialises a full [E, ., .] gradient)."""
        outs, start = [], 0
        for e, n in enumerate(self._check(counts).tolist()):
            if n:
                outs.append(self._expert(e, x_sorted[start : start + n]))
                start += n
        if not outs:
            anchor = sum(p.sum() for p in self.parameters(recurse=False)) * 0.0
            return x_sorted.new_zeros(0, self.w_down.shape[-1]) + anchor
        return torch.cat(outs)


class MoE(nn.Module):
    # The ranks holding the other parts of each sequence, over which the auxiliary loss sums its statistics:
    cp = None  # backend.context_parallel.ContextShard (context parallelism), set by shard_context
    sequence_group = None  # the tp process group under sequence parallelism, set by backend.tensor_parallel

    def __init__(self, spec: ModelSpec, *, combine_sum: float = 1.0):
        super().__init__()
        m, d = spec.moe, spec.d_model
        assert m is not None
        self.num_experts, self.top_k, self.combine_sum = m.experts, m.top_k, combine_sum
        self.router = Router(d, m.experts, m.router_bias, learned_bias=not m.sets_router_bias)
        self.groups, self.node_limit = m.expert_groups, m.node_limit
        self.aux_loss_weight = m.aux_loss_weight if m.balance_method == "aux_loss" else 0.0
        self.pending_aux_loss: Tensor | None = None
        self.count_steps = False  # set by frontier_routing.AuxFreeBiasBalancer
        self.step_counts: Tensor | None = None
        self.latent_down = nn.Linear(d, m.latent_dim, bias=False) if m.latent_dim else None
        self.latent_norm = RMSNorm(m.latent_dim) if m.latent_dim else None
        self.latent_up = nn.Linear(m.latent_dim, d, bias=False) if m.latent_dim else None
        self.experts = GroupedExperts(m.experts, spec.expert_input_dim, m.expert_ffn, spec.activation, spec.mlp_bias)
        self.shared = nn.ModuleList(
            Mlp(d, m.shared_ffn, spec.activation, spec.mlp_bias) for _ in range(m.shared_experts)
        )
        self.balanced_routing = False  # set by backend.train for expert_transport.routing: balanced
        self.collect_margins = False  # set by QuantileBalancer
        self.margins: list[Tensor] = []  # [T, E] fp32 margins s - a_t per training forward, until the balancer reads
        self.last_routing_counts: Tensor | None = None
        self.routing_counts_sum: Tensor | None = None
        # positions of each sequence that hold tokens; the rest are padding, neither routed nor counted (None: all).
        # Set per forward by backend.mtp, whose last context rank pads its chunk past the sequence's end
        self.valid_positions: int | None = None

    # ------------------------------------------------------------------------------------------------ routing
    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, d_model] -> expert ids [T, K] (int64) and combine weights [T, K] (fp32, each row sums to combine_sum)."""
        logits = self.router(x)
        with torch.no_grad():
            biased = logits.detach()
            if self.router.bias is not None and not self.router.learned_bias:
                biased = biased + self.router.bias.float()
            if self.node_limit:
                biased = group_limited(biased, self.groups, self.node_limit)
            top_vals, top_idx = biased.topk(self.top_k + 1, dim=-1)
            if self.collect_margins and self.training:
                self.margins.append(logits.detach() - top_vals[:, self.top_k :])
        ids = top_idx[:, : self.top_k]
        if self.balanced_routing:  # forced choices, the router's scores at them (see the module)
            ids = balanced_assignment(x.shape[0], self.top_k, self.num_experts, x.device)
        weights = torch.sigmoid(logits.gather(1, ids))
        weights = weights * (self.combine_sum / weights.sum(-1, keepdim=True))
        self._record_counts(ids)
        if self.aux_loss_weight and self.training:
            self.pending_aux_loss = switch_aux_loss(logits, ids, self.aux_loss_weight, self._token_totals())
        return ids, weights

    def _token_totals(self):
        """Sum of a tensor over the ranks holding the rest of this micro-batch's tokens, or None (see cp)."""
        if self.cp is not None and self.cp.size > 1:
            return lambda t: sum_over_context(t, self.cp)
        if self.sequence_group is not None:
            return lambda t: sum_over_sequence_shards(t, self.sequence_group)
        return None

    def _record_counts(self, ids: Tensor) -> None:
        counts = torch.bincount(ids.reshape(-1), minlength=self.num_experts).detach()
        self.last_routing_counts = counts
        if self.count_steps and self.training:
            self.step_counts = counts.clone() if self.step_counts is None else self.step_counts + counts
        self.routing_counts_sum = counts.clone() if self.routing_counts_sum is None else self.routing_counts_sum + counts

    def reset_routing_counts(self) -> None:
        self.routing_counts_sum = None

    # ------------------------------------------------------------------------------------------------ dispatch
    def sort_by_expert(self, expert_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Assignment order grouped by expert (stable) and tokens per expert [E].

        order indexes the flattened [T*K] assignments; the token of assignment a is a // K.
        """
        flat = expert_ids.reshape(-1)
        return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=self.num_experts)

    def combine(self, y_sorted: Tensor, order: Tensor, weights: Tensor, num_tokens: int) -> Tensor:
        """Scale expert outputs (in `order`) by their combine weights and sum them per token -> [T, dim]."""
        w = weights.reshape(-1)[order].to(y_sorted.dtype)
        out = y_sorted.new_zeros(num_tokens, y_sorted.shape[-1])
        return out.index_add_(0, order // self.top_k, y_sorted * w[:, None])

    def dispatch_compute_combine(self, tokens: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        """Run the routed experts on `tokens` [T, dim] and return the weighted sum per token [T, dim].

        The default is single-process: every expert is local. Expert parallelism overrides this method.
        """
        order, counts = self.sort_by_expert(expert_ids)
        x_sorted = tokens.index_select(0, order // self.top_k)
        y_sorted = self.experts(x_sorted, counts)
        return self.combine(y_sorted, order, weights, tokens.shape[0])

    # ------------------------------------------------------------------------------------------------ forward
    def forward(self, x: Tensor) -> Tensor:
        """x [B, S, d_model] -> [B, S, d_model]; positions from valid_positions on give zeros (padding)."""
        n = self.valid_positions
        if n is not None and n < x.shape[1]:
            return F.pad(self._forward(x[:, :n]), (0, 0, 0, x.shape[1] - n))
        return self._forward(x)

    def _forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        expert_ids, weights = self.route(flat)
        routed_in = flat
        if self.latent_down is not None:
            routed_in = self.latent_norm(self.latent_down(flat))
        routed = self.dispatch_compute_combine(routed_in, expert_ids, weights)
        if self.latent_up is not None:
            routed = self.latent_up(routed)
        for shared in self.shared:
            routed = routed + shared(flat)
        if self.pending_aux_loss is not None:
            routed, self.pending_aux_loss = AttachedLoss.apply(routed, self.pending_aux_loss), None
        return routed.view(shape)
