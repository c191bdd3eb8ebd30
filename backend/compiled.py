"""torch.compile for the trainer (plan field `compile`, default false): where it applies and where it cannot run.

`compile_blocks(chunks)` compiles, in place, the parts of every transformer block whose shapes do not depend on the
routing: the attention sublayer with its norm, the MLP norm, and dense MLPs (a dense layer's, and a MoE layer's
shared experts). The routed experts stay eager: their sort, bincount and grouped GEMM offsets are data-dependent,
which torch.compile turns into graph breaks and recompilations rather than speed. Each module compiles on its first
forward (the first step pays it; backend.record keeps step times apart, so it shows in that step only).
`compile_problem()` says why torch.compile cannot run in this process (an unsupported Python for TorchDynamo, or a
CPU run without the C++ compiler TorchInductor's CPU code needs), '' when it can; backend.parallel.validate_trainable
refuses a plan with compile: true on such a machine, in one line naming the field.

    .venv/bin/pytest -q tests/test_compile.py
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from rackcast.backend.layers import Mlp
from rackcast.backend.model import Block

CXX_ENV = "CXX"  # TorchInductor's C++ compiler: $CXX, else the first of these on PATH (torch._inductor.cpp_builder)
CXX_DEFAULTS = ("g++", "clang++")


def compile_problem(cuda: bool | None = None) -> str:
    """Why torch.compile cannot run here ('' when it can)."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile (TorchDynamo) does not support this Python"
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if not cuda:
        names = [os.environ[CXX_ENV]] if os.environ.get(CXX_ENV) else list(CXX_DEFAULTS)
        if not any(shutil.which(n) for n in names):
            return f"torch.compile on CPU needs a C++ compiler ({' or '.join(names)} on PATH) and none was found"
    return ""


def compile_targets(chunk: nn.Module) -> list[nn.Module]:
    """The modules of `chunk` that compile_blocks compiles (see the module docstring)."""
    out: list[nn.Module] = []
    for block in (m for m in chunk.modules() if isinstance(m, Block)):
        out += [block.attn_norm, block.attn, block.mlp_norm]
        out += [m for m in block.mlp.modules() if isinstance(m, Mlp)]
    return out


def compile_blocks(chunks: list[nn.Module]) -> int:
    """Compile every chunk's compile_targets in place (nn.Module.compile); returns how many modules."""
    targets = [m for chunk in chunks for m in compile_targets(chunk)]
    for m in targets:
        m.compile()
    return len(targets)
