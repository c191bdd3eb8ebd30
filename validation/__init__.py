"""Predicted against measured: calibrate a topology from microbenchmarks, compare a run with its prediction, fit an
efficiency profile to measured runs, and validate the simulator over a suite of local plans.

This layer sits above the simulator, the planner and the backend (it runs the trainer and the simulator on the same
plans) and below the front ends (CLI, TUI).
"""
