"""The budgets repository: the SQL of ``budgets`` (:class:`~broker.service.store.tables.Budget`) and the two sums a
budget's state needs (:mod:`broker.service.budgets`).

Functions take an open :class:`~sqlalchemy.orm.Session` (``s``) so the caller decides the transaction.

* :func:`budget_rows`, :func:`put_budget`, :func:`delete_budget` — the caps;
* :func:`cloud_spent` — billed USD of the ledger's cloud lines per team in a period;
* :func:`cloud_committed` — the planner's estimate (USD) of the cloud attempts not metered yet, per team.
"""

from __future__ import annotations

import logging
import math

from datetime import datetime

from sqlalchemy import case, delete, func, select
from sqlalchemy.orm import Session

from broker.service.store.tables import Budget, Job, UsageRow
from broker.states import ACTIVE_STATE_VALUES

log = logging.getLogger(__name__)

__all__ = ["budget_rows", "put_budget", "delete_budget", "cloud_spent", "cloud_committed"]


def budget_rows(s: Session, team: str | None = None) -> list[Budget]:
    """Inside ``s``: the budgets, by team (only ``team``'s when given)."""
    q = select(Budget).order_by(Budget.team)
    if team is not None:
        q = q.where(Budget.team == team)
    return list(s.execute(q).scalars())


def put_budget(s: Session, team: str, cap_usd: float, alert_fraction: float, now: datetime, by: str) -> Budget:
    """Inside ``s``: set ``team``'s cap and alert fraction (insert or update; a changed cap or fraction clears the
    month's raised alert so a new threshold can fire). Returns the row."""
    row = s.get(Budget, team)
    if row is None:
        row = Budget(team=team, cap_usd=cap_usd, alert_fraction=alert_fraction, alerted_month=None,
                     updated_at=now, updated_by=by)
        s.add(row)
    else:
        if (row.cap_usd, row.alert_fraction) != (cap_usd, alert_fraction):
            row.alerted_month = None
        row.cap_usd, row.alert_fraction, row.updated_at, row.updated_by = cap_usd, alert_fraction, now, by
    s.flush()
    return row


def delete_budget(s: Session, team: str) -> bool:
    """Inside ``s``: remove ``team``'s budget; ``False`` when it had none."""
    return s.execute(delete(Budget).where(Budget.team == team)).rowcount > 0


def cloud_spent(s: Session, start: datetime, end: datetime, teams: list[str] | None = None
                ) -> dict[str, tuple[float, int]]:
    """Inside ``s``: per team, ``(billed USD, lines with an unknown cost)`` of the ledger's cloud lines (provider
    not ``onprem``) whose window starts in ``[start, end)`` (UTC). Only ``teams``' when given."""
    q = (select(UsageRow.team, func.coalesce(func.sum(UsageRow.billed_usd), 0.0),
                func.sum(case((UsageRow.billed_usd.is_(None), 1), else_=0)))
         .where(UsageRow.provider != "onprem", UsageRow.start >= start, UsageRow.start < end)
         .group_by(UsageRow.team))
    if teams is not None:
        q = q.where(UsageRow.team.in_(teams))
    return {t: (float(usd), int(unknown or 0)) for t, usd, unknown in s.execute(q)}


def cloud_committed(s: Session, teams: list[str] | None = None) -> dict[str, tuple[float, int]]:
    """Inside ``s``: per team, ``(USD, attempts)`` committed to cloud attempts not metered yet: the jobs in an
    active state (provisioning, starting, running) placed on a cloud offer, each counted at the ``dollars_usd``
    of the decision that placed it (the planner's estimate of the whole attempt: price x expected runtime,
    the spot rework and the billing minimum included). The ledger writes the attempt's actual lines in the
    transaction that ends it, which also leaves the active states, so an attempt is never counted twice."""
    q = select(Job.team, Job.placement, Job.decision).where(Job.state.in_(ACTIVE_STATE_VALUES))
    if teams is not None:
        q = q.where(Job.team.in_(teams))
    out: dict[str, tuple[float, int]] = {}
    for team, placement, decision in s.execute(q):
        if (placement or {}).get("kind") != "cloud":
            continue
        raw = ((decision or {}).get("option") or {}).get("dollars_usd") if isinstance(decision, dict) else None
        try:
            usd = float(raw)
        except (TypeError, ValueError):
            usd = math.nan
        if not math.isfinite(usd):  # a decision record without a usable estimate must not stop the planning cycle
            log.warning("team %s: an active cloud job's decision has no finite dollars_usd (%r): committed as 0, "
                        "the ledger's lines count it when the attempt ends", team, raw)
            usd = 0.0
        usd0, n0 = out.get(team, (0.0, 0))
        out[team] = (usd0 + usd, n0 + 1)
    return out
