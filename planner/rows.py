"""The layout search's candidates as rows: `Row` (one candidate and its figures) and `Rejected`, the layouts the
search refused, kept as the enumeration's list and memory arrays rather than one Row each.

Most searches refuse far more layouts than they rank (Marin on 11 NVL72 racks: 21,529 of 26,463), and only
--parquet, --explain and the no-fit error read them one by one, so the closed-form stage stores them in bulk and
`Rejected.rows()` builds their Rows on first use, the same Rows the search used to build eagerly.

    from rackcast.planner.rows import Rejected, Row
    rejected = Rejected(invalid=found.rejected, over_memory=OverMemory(...))
    rejected.counts()          # {"invalid": ..., "no_fit": ...}, no Rows built
    rejected.rows()            # the Rows, invalid first, then over memory in enumeration order
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rackcast.topologies.spec import Topology
from rackcast.units import GIB

from rackcast.planner.space import Layout

MEMORY_PARTS = ("weights", "gradients", "master", "optimizer", "activations", "buffers", "total", "host")


@dataclass
class Row:
    """One candidate and its figures (NaN where a stage did not reach it)."""

    layout: Layout
    status: str  # ranked | invalid | no_fit
    reason: str = ""
    memory: dict = field(default_factory=dict)  # MemoryBreakdown.as_dict() per GPU
    host_per_host: float = math.nan
    step_time_s: float = math.nan
    tokens_per_s: float = math.nan
    mfu: float = math.nan
    days: float = math.nan  # steady-state days to the token budget
    phases: dict = field(default_factory=dict)
    drop_fraction: float = 0.0
    sim: dict = field(default_factory=dict)  # simulated figures when simulated
    rank: int = 0  # 1-based among ranked rows

    @property
    def best_tokens_per_s(self) -> float:
        return self.sim.get("tokens_per_s", self.tokens_per_s)

    @property
    def best_mfu(self) -> float:
        return self.sim.get("mfu", self.mfu)

    @property
    def best_days(self) -> float:
        return self.sim.get("days", self.days)

    @property
    def peak_memory(self) -> float:
        return self.sim.get("peak_memory_bytes", self.memory.get("total", math.nan))


def no_fit_reason(mem: dict, host_per_host: float, topo: Topology) -> str:
    if mem["total"] > topo.accelerator.hbm_bytes:
        return f"memory per GPU {mem['total'] / GIB:.1f} GiB > HBM {topo.accelerator.hbm_bytes / GIB:.1f} GiB"
    return (f"host memory {host_per_host / GIB:.1f} GiB per host > {topo.host.memory_bytes / GIB:.1f} GiB "
            f"(offloaded optimizer state)")


@dataclass
class OverMemory:
    """Layouts that fit under no recomputation or optimizer-state choice, each with its leanest choice's memory."""

    layouts: list[Layout]  # the layouts memory was computed for (index points into it)
    index: np.ndarray  # which of them fit nowhere, ascending
    choices: list[tuple[str, str]]  # (recompute, opt_location) of each choice tried
    choice: np.ndarray  # per entry: the leanest choice (into `choices`)
    memory: dict[str, np.ndarray]  # per entry: MEMORY_PARTS and "host_per_host"
    topos: dict[int, Topology]  # per GPUs used per domain: the topology the fit was checked on

    def __len__(self) -> int:
        return len(self.index)

    def rows(self) -> list[Row]:
        lists = {k: v.tolist() for k, v in self.memory.items()}
        out = []
        for k, i, c in zip(range(len(self.index)), self.index.tolist(), self.choice.tolist()):
            lay = self.layouts[i]
            rc, loc = self.choices[c]
            cand = Layout(lay.usable, lay.parallel, lay.global_batch, lay.micro_batch, lay.schedule, rc, loc,
                          lay.transport)
            mem = {p: lists[p][k] for p in MEMORY_PARTS}
            hph = lists["host_per_host"][k]
            out.append(Row(cand, "no_fit", no_fit_reason(mem, hph, self.topos[cand.usable]), mem, hph))
        return out


@dataclass
class Rejected:
    """The refused layouts: by the divisibility rules (planner.space's text) and over memory."""

    invalid: list[tuple[Layout, str]] = field(default_factory=list)
    over_memory: list[OverMemory] = field(default_factory=list)
    _built: list[Row] | None = field(default=None, repr=False)  # rows(), built on first use

    def counts(self) -> dict[str, int]:
        return {"invalid": len(self.invalid), "no_fit": sum(len(x) for x in self.over_memory)}

    def rows(self) -> list[Row]:
        if self._built is None:
            self._built = [Row(layout=lay, status="invalid", reason=why) for lay, why in self.invalid]
            for part in self.over_memory:
                self._built += part.rows()
        return list(self._built)
