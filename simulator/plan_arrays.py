"""Many plans as arrays: the layout fields that differ between candidates, one numpy array per field.

The planner prices tens of thousands of layouts of one model on one topology. `PlanArrays` holds them as columns
(the parallel degrees and layers per chunk, GPUs used per domain, batch, schedule, recomputation, optimizer-state location, expert
transport) over a template Plan that supplies every other field. The cost functions that take a plan
(simulator.estimate.plan_features, simulator.memory.memory_breakdown, rank_params, ...) take a PlanArrays too and
answer with arrays, one element per plan, from the same formulas:

- arithmetic on the layout's degrees runs on the arrays (`.parallel` is a rackcast.layout.ParallelSpec whose
  fields are arrays, so its derived sizes are arrays too; `.batch` likewise);
- what a scalar function computes from a few fields (a per-layer sum over the layers a pipeline rank holds, a
  schedule formula, a placement) runs once per distinct combination of those fields (`per_key`), on a plan built
  from the template and that combination, and is gathered back to every plan that shares it.

`per_key(plan, fields, fn)` accepts a single Plan as well (then it is just fn(plan)), so one function body serves
both. A field `fn` reads but `fields` does not name would take the template's value: tests/test_plan_arrays.py
checks every array result against the single-plan one over sampled layouts of several models and topologies.

    arrays = PlanArrays(template, {"tensor": [1, 2, 4], "micro_batch": [1, 1, 2], ...})
    simulator.estimate.plan_features(spec, arrays, topo)["attn_flops"]   # one element per plan
"""

from __future__ import annotations

import copy
from dataclasses import fields as dc_fields, replace
from typing import Callable, Sequence

import numpy as np

from rackcast.layout import ParallelSpec
from rackcast.plan import BatchSpec, Plan

PARALLEL_FIELDS = tuple(f.name for f in dc_fields(ParallelSpec))
COLUMNS = (*PARALLEL_FIELDS, "usable", "global_batch", "micro_batch", "schedule", "recompute", "state_location",
           "transport")
_STRING_COLUMNS = ("schedule", "recompute", "state_location")
_OBJECT_COLUMNS = ("transport", "stage_layers")  # ExpertTransport objects; layers per chunk (tuples)
LAYER_SET = ("pipeline", "virtual", "schedule", "stage_layers")  # what decides which layers a pipeline rank holds


class PlanArrays:
    """Plans that share a template and differ in the COLUMNS fields. `transport` holds ExpertTransport objects;
    `usable` the GPUs used per domain (the template's topology otherwise)."""

    def __init__(self, template: Plan, columns: dict[str, Sequence]):
        unknown = set(columns) - set(COLUMNS)
        if unknown:
            raise ValueError(f"PlanArrays: unknown columns {sorted(unknown)}; known: {COLUMNS}")
        n = {len(v) for v in columns.values()}
        if len(n) > 1:
            raise ValueError(f"PlanArrays: columns of different lengths {sorted(n)}")
        self.template = template
        self.n = n.pop() if n else 1
        self._codes: dict[str, np.ndarray] = {}
        self._values: dict[str, list] = {}
        for name in COLUMNS:
            column = columns.get(name)
            if column is None:
                self._values[name], self._codes[name] = [_template_value(template, name)], np.zeros(self.n, np.int64)
            else:
                self._values[name], self._codes[name] = _encode(column)
        self._derive()

    def replace(self, **columns) -> "PlanArrays":
        """The same plans with some columns replaced (the others are shared, not re-encoded)."""
        out = copy.copy(self)
        out._codes, out._values = dict(self._codes), dict(self._values)
        for name, column in columns.items():
            if name not in COLUMNS or len(column) != self.n:
                raise ValueError(f"PlanArrays.replace: {name} is not a column of length {self.n}")
            out._values[name], out._codes[name] = _encode(column)
        out._derive()
        return out

    def _derive(self) -> None:
        template = self.template
        self._plans: dict[int, Plan] = {}
        self.parallel = ParallelSpec(**{k: self.column(k) for k in PARALLEL_FIELDS})
        self.batch = BatchSpec(global_batch=self.column("global_batch"), micro_batch=self.column("micro_batch"))
        self.usable = self.column("usable")
        self.schedule = self.column("schedule")
        self.recompute = self.column("recompute")
        self.state_location = self.column("state_location")
        # Fields every plan shares (the template's).
        self.optimizer = template.optimizer  # its state_location is per plan: see .state_location
        self.precision, self.grad_dtype = template.precision, template.grad_dtype
        self.attention_kernel, self.dropout, self.seed = template.attention_kernel, template.dropout, template.seed
        self.overlap_grad_reduce, self.compile = template.overlap_grad_reduce, template.compile

    def __len__(self) -> int:
        return self.n

    def column(self, name: str) -> np.ndarray:
        values = self._values[name]
        if name in _STRING_COLUMNS:
            return np.array(values)[self._codes[name]]
        if name in _OBJECT_COLUMNS:
            table = np.empty(len(values), dtype=object)  # filled one by one: tuples must not become a 2-d array
            for i, v in enumerate(values):
                table[i] = v
            return table[self._codes[name]]
        return np.array(values, dtype=np.int64)[self._codes[name]]

    @property
    def microbatches(self) -> np.ndarray:
        return self.parallel.microbatches(self.batch.global_batch, self.batch.micro_batch)

    def tokens_per_microbatch(self, spec) -> np.ndarray:
        return self.parallel.tokens_per_microbatch(self.batch.micro_batch, spec.seq_len)

    def routed_tokens_per_microbatch(self, spec) -> np.ndarray:
        return self.parallel.routed_tokens_per_microbatch(self.batch.micro_batch, spec.seq_len)

    def plan(self, i: int) -> Plan:
        """The i-th plan (built once, kept)."""
        plan = self._plans.get(i)
        if plan is None:
            plan = self._plans[i] = self._build({name: self._values[name][self._codes[name][i]] for name in COLUMNS})
        return plan

    def _build(self, values: dict) -> Plan:
        """The template with `values` set, built without dataclasses.replace's per-field checks (the planner builds
        thousands; every value is one the caller's plans hold)."""
        t = self.template
        plan = copy.copy(t)
        set_field = object.__setattr__
        set_field(plan, "parallel", ParallelSpec(**{k: values[k] for k in PARALLEL_FIELDS}))
        set_field(plan, "batch", BatchSpec(global_batch=values["global_batch"], micro_batch=values["micro_batch"]))
        set_field(plan, "schedule", values["schedule"])
        set_field(plan, "recompute", values["recompute"])
        if values["state_location"] != t.optimizer.state_location:
            set_field(plan, "optimizer", replace(t.optimizer, state_location=values["state_location"]))
        set_field(plan, "expert_transport", values["transport"])
        if values["usable"] != t.topology.usable_gpus:
            set_field(plan, "topology", replace(t.topology, usable_gpus=values["usable"]))
        return plan

    def key_index(self, fields: Sequence) -> tuple[np.ndarray, np.ndarray]:
        """(first plan of each distinct combination of `fields`, the combination each plan has). A field is a
        column name or an array of derived values (e.g. micro-batches per step), one per plan."""
        key = np.zeros(self.n, dtype=np.int64)
        for f in fields:
            if isinstance(f, str):
                codes, count = self._codes[f], len(self._values[f])
            else:
                values, codes = np.unique(np.broadcast_to(f, (self.n,)), return_inverse=True)
                codes, count = codes.reshape(-1), len(values)
            if key.max(initial=0) >= np.iinfo(np.int64).max // (count + 1):  # renumber before the radix overflows
                key = np.unique(key, return_inverse=True)[1].reshape(-1)
            key = key * count + codes
        _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
        return first, inverse.reshape(-1)

    def per_key(self, fields: Sequence, fn: Callable[[Plan], object]) -> tuple[np.ndarray, ...]:
        """fn(plan) -> float or tuple of floats, evaluated once per distinct combination of `fields` (on the first
        plan that has it) and gathered to every plan: one array per element of fn's answer."""
        table = self.per_key_table(fields, fn)
        return tuple(table[:, j] for j in range(table.shape[1]))

    def per_key_table(self, fields: Sequence, fn: Callable[[Plan], object], rows=None) -> np.ndarray:
        """per_key's answers as one (plans, elements) array; `rows` (an index array): only those plans' (fn
        evaluated only on the combinations they have)."""
        first, inverse = self.key_index(fields)
        if rows is not None:
            used, inverse = np.unique(inverse[rows], return_inverse=True)
            first, inverse = first[used], inverse.reshape(-1)
        return np.array([fn(self.plan(i)) for i in first], dtype=float).reshape(len(first), -1)[inverse]


def per_key(plan: Plan | PlanArrays, fields: Sequence[str], fn: Callable[[Plan], object]) -> tuple:
    """fn(plan) for a single Plan (as a tuple); for PlanArrays, PlanArrays.per_key."""
    if isinstance(plan, PlanArrays):
        return plan.per_key(fields, fn)
    answer = fn(plan)
    return tuple(answer) if isinstance(answer, (tuple, list)) else (answer,)


def per_key_table(plan: Plan | PlanArrays, fields: Sequence[str], fn: Callable[[Plan], object],
                  rows=None) -> np.ndarray:
    """fn(plan)'s floats as an array: (elements,) for a single Plan; for PlanArrays, PlanArrays.per_key_table (of
    the plans `rows`, where given)."""
    if isinstance(plan, PlanArrays):
        return plan.per_key_table(fields, fn, rows)
    return np.asarray(fn(plan), dtype=float).reshape(-1)


def state_location(plan: Plan | PlanArrays):
    """Where optimizer state lives, per plan ("hbm" or "host")."""
    return plan.state_location if isinstance(plan, PlanArrays) else plan.optimizer.state_location


def is_arrays(plan) -> bool:
    return isinstance(plan, PlanArrays)


def _template_value(t: Plan, name: str):
    if name in PARALLEL_FIELDS:
        return getattr(t.parallel, name)
    if name in ("global_batch", "micro_batch"):
        return getattr(t.batch, name)
    if name == "state_location":
        return t.optimizer.state_location
    if name == "transport":
        return t.expert_transport
    if name == "usable":
        return t.topology.usable_gpus
    return getattr(t, name)


def _encode(column: Sequence) -> tuple[list, np.ndarray]:
    """(distinct values, each element's index into them). Objects (expert transports) are told apart by identity:
    equal ones held twice only make two groups where one would do."""
    first = column[0] if len(column) else None
    if isinstance(first, (bool, int, str, np.integer, np.bool_, np.str_)):
        values, codes = np.unique(np.asarray(column), return_inverse=True)
        return values.tolist(), codes.reshape(-1).astype(np.int64)
    index: dict = {}
    objects: list = []
    codes = np.empty(len(column), dtype=np.int64)
    for i, v in enumerate(column):
        key = v if isinstance(v, tuple) else id(v)  # tuples (layers per chunk) by value
        k = index.get(key)
        if k is None:
            k = index[key] = len(objects)
            objects.append(v)
        codes[i] = k
    return objects, codes
