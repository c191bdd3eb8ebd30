"""Attach an extra loss term (multi-token prediction, auxiliary load balancing) to a tensor on the main loss's path,
so the main loss's backward also backpropagates it, without changing what the model returns or how the trainer and
the pipeline compute the loss (as Megatron-LM's MoEAuxLossAutoScaler does).

    y = AttachedLoss.apply(y, extra)    # forward: y unchanged; backward: extra receives backward_scale
The trainer sets `AttachedLoss.backward_scale` to the factor it scales the main loss by before backward (1 / the
micro-batches of a step), so the extra term is weighted as if it had been added to the loss.
"""

from __future__ import annotations

import torch
from torch import Tensor


class AttachedLoss(torch.autograd.Function):
    backward_scale = 1.0

    @staticmethod
    def forward(ctx, carrier: Tensor, extra: Tensor) -> Tensor:
        ctx.save_for_backward(extra)
        return carrier.view_as(carrier)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (extra,) = ctx.saved_tensors
        return grad, torch.full_like(extra, AttachedLoss.backward_scale)
