"""Profilers: the model (time, memory per module and shape) and the data (per-sample shapes)."""
