"""Optimizers: MuonH with AdamH and Adam groups (Marin 535B-A23B's "hyperball" recipe), and AdamW.

Groups, assigned by `param_groups(model)`; the first rule that matches wins:
1. a module's `OPTIM_GROUPS[param_name]` (GroupedExperts' 2-D expert biases -> adam);
2. a module's `OPTIM_GROUP` (Router weight and balancing bias, the attention HeadGate, ShortConv kernels -> adam;
   the untied output head LMHead -> adamh);
3. nn.Embedding (token embedding, learned positions) -> adam;
4. any parameter with fewer than 2 dims (norm gains, LayerNorm/Linear biases, the latent RMSNorm gain) -> adam;
5. everything else, i.e. 2-D and 3-D matrices (attention Q/K/V/O, routed expert stacks [E, ., .], shared experts,
   dense MLPs, latent down/up projections, gated-norm matrices) -> muonh.
Tied weights appear once (the tied head is the embedding: adam).

Rules (Marin 535B-A23B, https://github.com/marin-community/marin/issues/8435 and its
experiments/grug/moe_hero_ep/optimizer.py):
- muonh: Nesterov momentum (buf = mu*buf + g; u = g + mu*buf), then NEWTON_SCHULZ_STEPS (rackcast.vocab)
  quintic Newton-Schulz steps with the coefficients (3.4445, -4.7750, 2.0315) (Jordan et al., Muon), then the
  hyperball step; the matrices of one shape
  (expert stacks split into their matrices) run both as one batch (muonh_update_).
- adamh: the Adam direction m_hat / (sqrt(v_hat) + eps), then the hyperball step, at the MuonH learning rate.
- adam: plain Adam at adam_lr. Moments and steps over a group run as foreach ops (one call per op for all tensors).
- hyperball: W' = W - lr * U * |W|_F / max(|U|_F, 1e-10); W_new = W' * |W|_F / max(|W'|_F, 1e-10), per matrix,
  and per expert (norms over the last two dims) for [E, ., .] stacks, so each matrix keeps its Frobenius norm.
- fused projections (backend.layers.FusedLinear: attention Q/K/V, SwiGLU gate/up; GroupedExperts.w_gate_up) are
  one parameter run as one matmul, but their parts stay separate matrices here: a module's `matrix_parts`
  ({param: (dim, sizes)}) splits the parameter into views, each orthogonalised and hyperball-stepped as its own
  matrix (`parameter_parts`), as the reference models do with separate Q, K, V and gate, up matrices (Marin; Muon
  orthogonalises each weight matrix). Orthogonalising the fused matrix whole would couple the parts' singular
  values and give Q, K and V one shared norm budget, a different optimizer from the one the model is copied from.
No weight decay and no gradient clipping in MuonH (Marin). State: one momentum buffer per muonh parameter, two
moments per adam/adamh parameter (and none for parameters that never get a gradient, e.g. the balancing bias).
AdamW (torch.optim.AdamW) is the alternative: weight decay on the muonh and adamh groups' matrices, none elsewhere.

    opt = build_optimizer(model, "muonh")   # or "adamw"
    .venv/bin/pytest -q tests/test_backend_optim.py
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
from torch import Tensor, nn

from rackcast.vocab import NEWTON_SCHULZ_STEPS

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz (Keller Jordan's Muon)
NORM_FLOOR = 1e-10  # Marin: max(|U|_F, 1e-10)
MARIN_LR = 0.003291  # MuonH / AdamH learning rate of the 535B run
MARIN_ADAM_LR = 0.000759
MARIN_BETAS = (0.90, 0.95)
ADAMW_LR = 3e-4
ADAMW_WEIGHT_DECAY = 0.1

GroupName = Literal["muonh", "adamh", "adam"]
GROUPS: tuple[GroupName, ...] = ("muonh", "adamh", "adam")


# -------------------------------------------------------------------------------------------------- grouping
def _group_of(module: nn.Module, name: str, p: nn.Parameter) -> GroupName:
    overrides = getattr(module, "OPTIM_GROUPS", {})
    if name in overrides:
        return overrides[name]
    if hasattr(module, "OPTIM_GROUP"):
        return module.OPTIM_GROUP
    if isinstance(module, nn.Embedding) or p.ndim < 2:
        return "adam"
    return "muonh"


def param_group_names(model: nn.Module) -> dict[str, GroupName]:
    """Qualified parameter name -> group, each parameter once (see the module docstring for the rule)."""
    out: dict[str, GroupName] = {}
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            out[f"{mod_name}.{name}" if mod_name else name] = _group_of(module, name, p)
    return out


def parameter_parts(model: nn.Module) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Qualified parameter name -> (dim, part sizes) for fused parameters whose parts are separate matrices (a
    module's `matrix_parts`, backend.layers.FusedLinear and backend.moe.GroupedExperts); others are absent."""
    out = {}
    for mod_name, module in model.named_modules():
        for name, parts in getattr(module, "matrix_parts", {}).items():
            out[f"{mod_name}.{name}" if mod_name else name] = parts
    return out


def param_groups(model: nn.Module) -> dict[GroupName, list[nn.Parameter]]:
    """Parameters per group ("muonh", "adamh", "adam"), each parameter exactly once."""
    params = dict(model.named_parameters())
    groups: dict[GroupName, list[nn.Parameter]] = {g: [] for g in GROUPS}
    for name, group in param_group_names(model).items():
        groups[group].append(params[name])
    return groups


# -------------------------------------------------------------------------------------------------- MuonH
def newton_schulz(g: Tensor, steps: int = NEWTON_SCHULZ_STEPS, eps: float = 1e-7) -> Tensor:
    """Approximately orthogonalise each matrix of g [..., m, n] (singular values pushed into about [0.7, 1.2]).

    The quintic iteration X <- aX + (b A + c A^2) X with A = X X^T, after scaling X to unit Frobenius norm; run on
    the wide orientation so A is the smaller Gram matrix. Computed in fp32.
    """
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    shape = x.shape
    x = x.reshape(-1, *shape[-2:])  # a batch of matrices, so each product is one bmm / baddbmm call
    wide = x.shape[-2] <= x.shape[-1]
    if not wide:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + eps)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A^2
        x = torch.baddbmm(x, poly, x, beta=a)  # a X + (b A + c A^2) X
    return (x if wide else x.mT).reshape(shape)


def natural_order(t: Tensor, parts) -> Tensor:
    """A fused parameter (or its update) in its parts' order: a tensor-parallel fused weight stores each rank's
    rows of every part together (backend.tensor_parallel), parts (dim, sizes, stored) with stored[i] the part-order
    index of stored row i; other parts specs ((dim, sizes)) are already in order."""
    if parts is None or len(parts) < 3:
        return t
    dim, _, stored = parts
    return t.new_empty(t.shape).index_copy_(dim % t.ndim, stored.to(t.device), t)


def stored_order(t: Tensor, parts) -> Tensor:
    """The inverse of natural_order."""
    if parts is None or len(parts) < 3:
        return t
    dim, _, stored = parts
    return t.index_select(dim % t.ndim, stored.to(t.device))


def newton_schulz_parts(g: Tensor, steps: int, parts: tuple | None) -> Tensor:
    """newton_schulz of each part of each matrix of g (parts: (dim, sizes[, stored order])), or of whole matrices
    when None."""
    if parts is None:
        return newton_schulz(g, steps)
    dim, sizes = parts[:2]
    g = natural_order(g, parts)
    return stored_order(torch.cat([newton_schulz(piece, steps) for piece in g.split(sizes, dim)], dim), parts)


def orthogonalise(u: Tensor, steps: int = 5, parts: tuple | None = None) -> Tensor:
    """newton_schulz on whole matrices (or on each part of a fused one, `parts`), also for FSDP2 shards (DTensors
    sharded along dim 0) and tensor-parallel shards (DTensors sharded along either matrix dim, backend.tensor_parallel).

    A 3-D expert stack [E, m, n] sharded along E holds whole matrices on each rank: orthogonalised locally, no
    communication. A 2-D matrix sharded along its rows or columns needs the whole matrix: its update is all-gathered
    (full_tensor: (shards - 1) / shards of the matrix's fp32 bytes received per rank), orthogonalised on every rank
    (the same result everywhere), and each rank keeps its own rows (no communication). The hyperball step that
    follows needs the Frobenius norms of W, U and W' over the whole matrix: DTensor reduces them (three scalar
    all-reduces per matrix).
    """
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    if not isinstance(u, DTensor):
        return newton_schulz_parts(u, steps, parts)
    within_matrices = any(isinstance(pl, Shard) and pl.dim >= u.ndim - 2 for pl in u.placements)
    if not within_matrices:
        local = newton_schulz_parts(u.to_local(), steps, parts)
        return DTensor.from_local(local, u.device_mesh, u.placements, shape=u.shape, stride=u.stride())
    return distribute_tensor(newton_schulz_parts(u.full_tensor(), steps, parts), u.device_mesh, u.placements,
                             src_data_rank=None)


def _fro(t: Tensor) -> Tensor:
    """Frobenius norm of each matrix (over the last two dims), kept broadcastable; whole-tensor for 1-D."""
    if t.ndim < 2:
        return t.norm().reshape([1] * t.ndim)
    return torch.linalg.matrix_norm(t, keepdim=True)


def _part_fro(t: Tensor, parts: tuple[int, tuple[int, ...]]) -> Tensor:
    """Frobenius norm of each part (parts: (dim, sizes) along one of the last two dims) of each matrix of t, spread
    over that part's rows or columns (broadcastable to t). For an FSDP2 DTensor sharded along the parts' dim, the
    squared sums per row or column are gathered (one float each), summed per part, and sharded again like t."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    dim, sizes = parts[:2]
    other = -1 if dim % t.ndim == t.ndim - 2 else -2
    sq = (t * t).sum(other, keepdim=True)
    sharded = isinstance(sq, DTensor)
    full = natural_order(sq.full_tensor() if sharded else sq, parts)
    norms = stored_order(torch.cat([piece.sum(dim, keepdim=True).sqrt().expand_as(piece)
                                    for piece in full.split(sizes, dim)], dim), parts)
    return distribute_tensor(norms, t.device_mesh, t.placements, src_data_rank=None) if sharded else norms


def hyperball(w: Tensor, update: Tensor, lr: float, parts: tuple[int, tuple[int, ...]] | None = None) -> Tensor:
    """W moved along `update` by lr of its own norm, then projected back onto its Frobenius sphere (per matrix, or
    per part of a fused matrix when `parts` is given), in fp32."""
    fro = _fro if parts is None else (lambda t: _part_fro(t, parts))
    w = w.float()
    u = update.float()
    w_norm = fro(w)
    moved = w - lr * u * (w_norm / fro(u).clamp(min=NORM_FLOOR))
    return moved * (w_norm / fro(moved).clamp(min=NORM_FLOOR))


@torch.no_grad()
def hyperball_step_(p: Tensor, update: Tensor, lr: float, parts: tuple[int, tuple[int, ...]] | None = None) -> None:
    """Move p along `update` by lr of its own norm, then project back onto its Frobenius sphere (per matrix, or
    per part)."""
    p.copy_(hyperball(p, update, lr, parts))


class MuonH(torch.optim.Optimizer):
    """One optimizer over the three kinds of group; each param group carries "kind" in {"muonh","adamh","adam"}."""

    def __init__(
        self,
        groups: list[dict],
        *,
        lr: float = MARIN_LR,
        betas: tuple[float, float] = MARIN_BETAS,
        eps: float = 1e-8,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = NEWTON_SCHULZ_STEPS,
    ):
        defaults = dict(lr=lr, betas=betas, eps=eps, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps)
        super().__init__(groups, defaults)
        for group in self.param_groups:
            if group.get("kind") not in GROUPS:
                raise ValueError(f"param group kind must be one of {GROUPS}, got {group.get('kind')!r}")
            if group["kind"] == "muonh" and any(p.ndim < 2 for p in group["params"]):
                raise ValueError("muonh groups take matrices (2-D or stacked 3-D) only")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            has_grad = [p.grad is not None for p in group["params"]]
            params = [p for p, g in zip(group["params"], has_grad) if g]
            if not params:
                continue
            if group["kind"] == "muonh":
                roles = group.get("roles") or [""] * len(has_grad)
                parts = group.get("parts") or [None] * len(has_grad)
                self._muonh(params, [r for r, g in zip(roles, has_grad) if g],
                            [pt for pt, g in zip(parts, has_grad) if g], group)
            else:
                self._adam(params, group)
        return loss

    def _muonh(self, params: list[Tensor], roles: list[str], parts: list, group: dict) -> None:
        """Nesterov momentum over the group with foreach ops, then Newton-Schulz and the hyperball step: batched
        over the matrices of one role and shape (muonh_update_) for plain tensors, one matrix at a time through
        orthogonalise for FSDP2 shards (DTensors), whose whole matrices must be gathered first."""
        grads = [p.grad for p in params]
        bufs = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            bufs.append(state["momentum_buffer"])
        mu = group["momentum"]
        plain, sharded = _split_sharded(range(len(params)), params)
        for idx in (plain, sharded):  # foreach ops take lists of one tensor kind
            if idx:
                torch._foreach_mul_([bufs[i] for i in idx], mu)
                torch._foreach_add_([bufs[i] for i in idx], [grads[i] for i in idx])
        updates: list[Tensor] = list(bufs)
        if group["nesterov"]:
            for idx in (plain, sharded):
                if idx:
                    for i, u in zip(idx, torch._foreach_add([grads[i] for i in idx], [bufs[i] for i in idx],
                                                            alpha=mu)):
                        updates[i] = u
        if plain:
            muonh_update_([params[i] for i in plain], [updates[i] for i in plain], group["lr"], group["ns_steps"],
                          [roles[i] for i in plain] if roles else None, [parts[i] for i in plain])
        for i in sharded:
            hyperball_step_(params[i], orthogonalise(updates[i], group["ns_steps"], parts[i]), group["lr"], parts[i])

    def _adam(self, params: list[Tensor], group: dict) -> None:
        """Adam moments and direction m_hat / (sqrt(v_hat) + eps) over the group with foreach ops (one kernel per
        op for all its tensors), then the Adam step or, for adamh, the hyperball step."""
        for p in params:
            state = self.state[p]
            if "exp_avg" not in state:
                state["step"] = 0
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
        by_step: dict[tuple, list[Tensor]] = {}  # bias corrections differ only where a parameter missed steps
        for p in params:  # foreach ops take lists of one tensor kind (plain or FSDP2 DTensor)
            by_step.setdefault((self.state[p]["step"], _is_sharded(p)), []).append(p)
        (b1, b2), eps = group["betas"], group["eps"]
        for (t, _), ps in by_step.items():
            grads = [p.grad for p in ps]
            exp_avg = [self.state[p]["exp_avg"] for p in ps]
            exp_avg_sq = [self.state[p]["exp_avg_sq"] for p in ps]
            torch._foreach_lerp_(exp_avg, grads, 1 - b1)
            torch._foreach_mul_(exp_avg_sq, b2)
            torch._foreach_addcmul_(exp_avg_sq, grads, grads, value=1 - b2)
            denom = torch._foreach_div(exp_avg_sq, 1 - b2**t)
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, eps)
            direction = torch._foreach_div(exp_avg, 1 - b1**t)
            torch._foreach_div_(direction, denom)
            if group["kind"] == "adamh":
                for p, u in zip(ps, direction):
                    hyperball_step_(p, u, group["lr"])
            else:
                torch._foreach_add_(ps, direction, alpha=-group["lr"])


def _is_sharded(t: Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _split_sharded(indices, params: list[Tensor]) -> tuple[list[int], list[int]]:
    """The indices of plain tensors and of FSDP2 DTensors among `params`."""
    plain = [i for i in indices if not _is_sharded(params[i])]
    return plain, [i for i in indices if _is_sharded(params[i])]


def _matrices(t: Tensor) -> Tensor:
    """t [..., m, n] as a stack of matrices [N, m, n] (a view: copies back into it reach the parameter)."""
    return t.view(-1, *t.shape[-2:])


def parameter_role(name: str) -> str:
    """A parameter's name without its layer and chunk indices ("layers.3.attn.qkv.weight" -> "layers.attn.qkv.weight"):
    the same matrix in every layer."""
    return ".".join(part for part in name.split(".") if not part.isdigit())


@torch.no_grad()
def muonh_update_(params: list[Tensor], updates: list[Tensor], lr: float, ns_steps: int,
                  roles: list[str] | None = None, parts: list | None = None) -> None:
    """For every matrix of `params` (2-D ones, and each [m, n] of a stacked [E, m, n]): orthogonalise its update
    with newton_schulz and take the hyperball step. The matrices of one role (parameter_role: the same parameter of
    every layer) and shape go through both as one batch (one chain of batched matmuls per batch, not one per
    matrix), then are copied back into their parameters. Batching by role rather than by shape alone keeps the
    number of batches, and so the op count, a matter of the model's structure, not of which of its widths happen to
    be equal (simulator.op_counts counts on a twin with other widths). A fused parameter with `parts` ((dim, sizes),
    parameter_parts) enters as one view per part, each part its own role."""
    roles = roles or [""] * len(params)
    params, updates, roles = list(params), list(updates), list(roles)
    for i, pt in enumerate(parts or []):
        if pt is not None:
            dim, sizes = pt
            params += list(params[i].split(sizes, dim))
            updates += list(updates[i].split(sizes, dim))
            roles += [f"{roles[i]}[{j}]" for j in range(len(sizes))]
    fused = {i for i, pt in enumerate(parts or []) if pt is not None}
    batches: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if i not in fused:
            batches.setdefault((roles[i], tuple(p.shape[-2:])), []).append(i)
    for idx in batches.values():
        ws = [_matrices(params[i]) for i in idx]
        u = torch.cat([_matrices(updates[i]) for i in idx]) if len(idx) > 1 else _matrices(updates[idx[0]])
        w = torch.cat(ws) if len(idx) > 1 else ws[0]
        new = hyperball(w, newton_schulz(u, ns_steps), lr)
        torch._foreach_copy_(ws, list(new.split([m.shape[0] for m in ws])))


# -------------------------------------------------------------------------------------------------- factory
def build_optimizer(
    model: nn.Module,
    name: Literal["muonh", "adamw"] = "muonh",
    *,
    lr: float | None = None,
    adam_lr: float | None = None,
    betas: tuple[float, float] = MARIN_BETAS,
    eps: float = 1e-8,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_steps: int = NEWTON_SCHULZ_STEPS,
    weight_decay: float = ADAMW_WEIGHT_DECAY,
) -> torch.optim.Optimizer:
    """MuonH (lr: MuonH/AdamH rate, adam_lr: the Adam group's; Marin's run values by default) or AdamW (lr only).

    Every param group carries "kind" (and AdamW groups "decay"), for logging and schedulers (torch LambdaLR scales
    each group's own initial lr, so the MuonH/Adam ratio is kept).
    """
    groups = param_groups(model)
    if name == "muonh":
        lr = MARIN_LR if lr is None else lr
        adam_lr = MARIN_ADAM_LR if adam_lr is None else adam_lr
        muonh_names = [n for n, g in param_group_names(model).items() if g == "muonh"]  # params' order
        fused = parameter_parts(model)
        spec = [
            {"params": groups["muonh"], "kind": "muonh", "lr": lr, "roles": [parameter_role(n) for n in muonh_names],
             "parts": [fused.get(n) for n in muonh_names]},
            {"params": groups["adamh"], "kind": "adamh", "lr": lr},
            {"params": groups["adam"], "kind": "adam", "lr": adam_lr},
        ]
        return MuonH([g for g in spec if g["params"]], lr=lr, betas=betas, eps=eps, momentum=momentum,
                     nesterov=nesterov, ns_steps=ns_steps)
    if name == "adamw":
        lr = ADAMW_LR if lr is None else lr
        spec = [
            {"params": groups["muonh"] + groups["adamh"], "kind": "decay", "weight_decay": weight_decay},
            {"params": groups["adam"], "kind": "no_decay", "weight_decay": 0.0},
        ]
        # foreach ops take lists of one tensor kind: tensor-parallel DTensors and plain tensors in groups of their own
        spec = [dict(g, params=[p for p in g["params"] if _is_sharded(p) == sharded]) for g in spec
                for sharded in (False, True)]
        return torch.optim.AdamW([g for g in spec if g["params"]], lr=lr, betas=betas, eps=eps, foreach=True)
    raise ValueError(f"unknown optimizer {name!r} (use 'muonh' or 'adamw')")


def marin_lr_lambda(total_steps: int, warmup_fraction: float = 0.01, floor: float = 0.05) -> Callable[[int], float]:
    """Marin's schedule as a LambdaLR factor: linear warmup over 1% of steps, linear decay to a 5% floor."""
    warmup = max(1, int(total_steps * warmup_fraction))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, total_steps - warmup)
        return max(floor, 1.0 - (1.0 - floor) * frac)

    return factor


def optimizer_state_numel(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Elements of per-parameter state tensors (scalar step counters excluded), per group kind."""
    out: dict[str, int] = {}
    for group in optimizer.param_groups:
        kind = group.get("kind", "default")
        for p in group["params"]:
            n = sum(v.numel() for v in optimizer.state.get(p, {}).values() if isinstance(v, Tensor) and v.ndim > 0)
            out[kind] = out.get(kind, 0) + n
    return out
