"""Billing rules: how many seconds a provider bills for an instance that ran ``run_s`` seconds.

The rules live with the prices (one home): :data:`BILLING_RULES` is the documented per-provider table,
:func:`billed_seconds` applies it. The usage ledger (:mod:`broker.service.ledger`) bills every cloud
instance line with it; the cost model (:func:`broker.planner.costs.cloud_bill_usd`) takes the same
minimum through :attr:`pricing.offers.CloudOffer.min_billed_s` (:data:`pricing.offers.MIN_BILLED_S`).

=========  ==========================  ===========  ============  ===============================================
provider   applies to                  minimum, s   increment, s  source
=========  ==========================  ===========  ============  ===============================================
aws        EC2 Linux/Ubuntu instances, 60           1             Amazon EC2 pricing, "Per Second Billing"
           On-Demand and Spot                                     (aws.amazon.com/ec2/pricing/): per-second
                                                                  billing with a 60-second minimum for Linux
                                                                  and Ubuntu instances, On-Demand, Reserved
                                                                  and Spot.
gcp        Compute Engine VMs and      60           1             Compute Engine "VM instance pricing", billing
           attached GPUs, on-demand                               model (cloud.google.com/compute/vm-instance-
           and Spot                                               pricing): vCPUs, memory and GPUs are charged
                                                                  for a minimum of 1 minute, then per second.
onprem     owned GPUs (no invoice)     0            1             none: on-prem usage is metered from the energy
                                                                  counter and the run's seconds; nothing is
                                                                  rounded.
=========  ==========================  ===========  ============  ===============================================

Not modelled (said so rather than guessed): AWS's Windows/RHEL/SUSE hourly minimums (the broker launches
Linux only); provider credits for a Spot instance the provider interrupts (the ledger meters the seconds
run, the conservative reading; the reconciliation against the invoice shows any credit).

Errors: ``ValueError`` naming ``provider`` for a provider with no rule, ``run_s`` for a negative or
non-finite duration.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import NamedTuple

from pricing.offers import MIN_BILLED_S

__all__ = ["BillingRule", "BILLING_RULES", "billing_rule", "billed_seconds"]


class BillingRule(NamedTuple):
    """One provider's billing granularity.

    Attributes:
        provider: ``"aws"``, ``"gcp"`` or ``"onprem"``.
        applies_to: what the rule covers (instance OS, markets).
        min_billed_s: minimum billed seconds per instance start.
        increment_s: billed time is rounded up to a whole number of these seconds.
        source: where the rule comes from.
    """

    provider: str
    applies_to: str
    min_billed_s: float
    increment_s: float
    source: str


BILLING_RULES: MappingProxyType = MappingProxyType({
    "aws": BillingRule("aws", "EC2 Linux/Ubuntu instances, On-Demand and Spot", MIN_BILLED_S, 1.0,
                       "Amazon EC2 pricing, 'Per Second Billing': per second, 60-second minimum (Linux, Ubuntu)"),
    "gcp": BillingRule("gcp", "Compute Engine VMs and attached GPUs, on-demand and Spot", MIN_BILLED_S, 1.0,
                       "Compute Engine 'VM instance pricing': 1-minute minimum, then per second"),
    "onprem": BillingRule("onprem", "owned GPUs (no invoice)", 0.0, 1.0,
                          "none: metered from the energy counter and the seconds run"),
})


def billing_rule(provider: str) -> BillingRule:
    """The :class:`BillingRule` of ``provider``. Raises ``ValueError`` naming the provider and the known ones."""
    try:
        return BILLING_RULES[provider]
    except (KeyError, TypeError):
        known = ", ".join(sorted(BILLING_RULES))
        raise ValueError(f"provider={provider!r}: no billing rule (known: {known})") from None


def billed_seconds(provider: str, run_s: float) -> float:
    """Seconds ``provider`` bills for an instance that ran ``run_s`` seconds (create call to termination).

    ``max(min_billed_s, ceil(run_s / increment_s) x increment_s)`` by :data:`BILLING_RULES`; a 45-s AWS
    instance is billed 60 s, a 61.2-s one 62 s. Raises ``ValueError`` naming ``run_s`` when it is negative
    or not finite, and ``provider`` when it has no rule.
    """
    rule = billing_rule(provider)
    if not isinstance(run_s, (int, float)) or not math.isfinite(run_s) or run_s < 0:
        raise ValueError(f"run_s={run_s!r}: must be a finite number of seconds >= 0")
    if rule.increment_s > 0:
        # a float just above a whole second (from datetime arithmetic) is not a new second: round to 1 us first
        run_s = math.ceil(round(run_s / rule.increment_s, 6)) * rule.increment_s
    return float(max(rule.min_billed_s, run_s))
