"""The trainer's dense matrix products are the GEMMs simulator.gemms lists, at the shapes and operand layouts
benchmarks/gemm_in_step.py reports: a one-process tiny-moe step captured by its dispatch mode runs, per micro-batch,
every listed GEMM but the short convolutions (shifted copies in the trainer) once forward as x @ W^T (layout NT, m
the micro-batch's tokens) and twice in backward: the data gradient dY @ W (NN, tokens x k x n) and the weight
gradient dY^T @ X (TN, n x k x tokens); and no other aten::mm outside the routed experts' grouped kernel."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

from rackcast.backend import train
from rackcast.backend.tiny_runs import write_plan
from rackcast.plan import load_plan
from rackcast.simulator.gemms import embed_gemms, layer_gemms, tail_work

ROOT = Path(__file__).resolve().parent.parent


def _benchmark():
    spec = importlib.util.spec_from_file_location("gemm_in_step", ROOT / "benchmarks" / "gemm_in_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_dense_product_of_a_step_is_a_listed_gemm_forward_nt_data_grad_nn_weight_grad_tn(tmp_path):
    plan_path = write_plan(tmp_path / "1p.yaml", {})
    plan = load_plan(plan_path)
    spec = plan.model_spec()
    tokens = int(plan.tokens_per_microbatch(spec))
    trainer = train.Trainer(train.parse_args(["--plan", str(plan_path), "--out", str(tmp_path / "run"), "--steps",
                                              "1", "--quiet", "--threads", "1"]))
    trainer._data()
    calls = _benchmark().capture(trainer, 1)

    listed = [g for i in range(spec.layers) for g in layer_gemms(spec, i)] + list(tail_work(spec).gemms) + \
        list(embed_gemms(spec))
    expected = Counter()
    for g in (g for g in listed if g.part != "conv"):
        expected[("forward", "NT", (tokens, g.n, g.k))] += plan.microbatches
        expected[("backward", "NN", (tokens, g.k, g.n))] += plan.microbatches
        expected[("backward", "TN", (g.n, g.k, tokens))] += plan.microbatches
    ran = Counter()
    for (op, phase, a, b, layout), row in calls.items():
        if op == "mm":
            ran[(phase, layout, (a[0], b[1], a[1]))] += row["calls"]
    assert ran == expected
