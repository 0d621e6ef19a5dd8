"""Tests of broker.planner: the pure planner (costs, capacity, windows, policies, the package's shape)."""
