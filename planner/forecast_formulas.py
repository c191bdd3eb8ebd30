"""Closed forms for checkpointed runs with exponential failures, used to check the Monte Carlo forecast and to show
beside it where they hold.

Notation (Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps"): M is the mean
time between failures of the whole job (1 / total failure rate), C the time to write one checkpoint, R the restart
cost after a failure, tau the compute time between checkpoints, W the total compute time (steady-state seconds).

"""

from __future__ import annotations

import math


def young_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young (1974): the compute interval minimising expected lost time, sqrt(2 C M) (first order, C << M)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly (2006) higher-order optimum: sqrt(2CM) (1 + sqrt(C/(2M))/3 + C/(18M)) - C for C < 2M, else M."""
    c, m = checkpoint_s, mtbf_s
    if c >= 2.0 * m:
        return m
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(c / (2.0 * m)) / 3.0 + c / (18.0 * m)) - c


def daly_expected_wall_s(work_s: float, interval_s: float, checkpoint_s: float, restart_s: float,
                         mtbf_s: float) -> float:
    """Daly (2006) expected wall time: M e^{R/M} (e^{(tau + C)/M} - 1) W / tau.

    Exact for: exponential failures of mean M striking at any time (also during checkpoints and restarts, a failure
    in a restart restarting it), each of the W / tau segments ending with a checkpoint, a failure losing the segment.
    """
    m = mtbf_s
    if math.isinf(m):
        return work_s / interval_s * (interval_s + checkpoint_s)
    return m * math.exp(restart_s / m) * math.expm1((interval_s + checkpoint_s) / m) * work_s / interval_s
