"""Measurement: the held-out evaluation's math, the step benchmark, FLOPs, and the run report with its plots."""
