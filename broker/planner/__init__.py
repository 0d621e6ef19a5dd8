"""The planner: a pure function of a snapshot and the clock (no I/O; ARCHITECTURE §3-§4).

* :mod:`.registry` — ``plan(snapshot, ctx) -> decisions`` and the policies by name;
* :mod:`.core` — inputs (:class:`~broker.planner.core.Snapshot`, :class:`~broker.planner.core.PlannerConfig`,
  :class:`~broker.planner.core.PolicyName`) and the context that costs options;
* :mod:`.costs` — the one cost model (USD, kWh, kgCO2e of an option) and the score;
* :mod:`.policy_base` — what every policy shares (the cycle's state, the on-prem queue pass);
* :mod:`.fifo`, :mod:`.backfill`, :mod:`.cheapest` — the simple policies;
* :mod:`.federated` — the product's policy (cost + carbon + time value over on-prem and cloud);
* :mod:`.capacity` — the free on-prem capacity index (best fit, release profile);
* :mod:`.windows` — the cheapest or cleanest start window over hourly signals.
"""

from broker.planner.core import (POLICY_NAMES, PendingJob, PlannerConfig, PlannerContext, PolicyName, RunningJob,
                                 Snapshot)
from broker.planner.registry import POLICIES, plan

#: the planner's public face: ``from broker.planner import plan, Snapshot, PlannerConfig``
__all__ = ["plan", "POLICIES", "POLICY_NAMES", "PolicyName", "PlannerConfig", "PlannerContext", "Snapshot",
           "PendingJob", "RunningJob"]
