"""Tests of broker.cli: the `fedbroker` commands (main, jobs, cloud) and `fedbroker serve`'s wiring."""
