"""The planner: a pure function of a snapshot and the clock (no I/O; ARCHITECTURE §3-§4).

* :mod:`.core` — inputs (:class:`~broker.planner.core.Snapshot`, :class:`~broker.planner.core.PlannerConfig`),
  the cost of an option, decision records, ``plan(snapshot) -> decisions``;
* :mod:`.policies` — the policy base (shared constraints) and the simple policies;
* :mod:`.federated` — the product's policy (cost + carbon + time value over on-prem and cloud);
* :mod:`.capacity` — the free on-prem capacity index (best fit, release profile);
* :mod:`.windows` — the cheapest or cleanest start window over hourly signals.
"""
