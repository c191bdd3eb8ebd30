"""Discrete-event simulator of a training step (SimPy): network, collectives, pipeline schedules, memory."""
