"""Tests of broker.sim: the simulator, the trace loaders and the report."""
