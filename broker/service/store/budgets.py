"""The budgets repository: the SQL of ``budgets`` (:class:`~broker.service.store.tables.Budget`, per team) and
``project_budgets`` (:class:`~broker.service.store.tables.ProjectBudget`, per team and project) and the two sums
a budget's state needs (:mod:`broker.service.budgets`).

Functions take an open :class:`~sqlalchemy.orm.Session` (``s``) so the caller decides the transaction.

* :func:`budget_rows`, :func:`project_budget_rows`, :func:`put_budget`, :func:`delete_budget` — the caps
  (``project=None``: the team's own budget); :func:`team_known` — whether a team has a token, a job or a budget;
* :func:`cloud_spent` — billed USD of the ledger's cloud lines per team (or per team and project) in a period;
* :func:`cloud_committed` — the planner's estimate (USD) of the cloud attempts not metered yet, per team (or per
  team and project).

The sums are keyed by team, or with ``by_project`` by ``(team, project)`` (``project`` ``None`` for the lines and
jobs that name none: they count in their team's budget and in no project's).
"""

from __future__ import annotations

import logging
import math

from datetime import datetime, timezone

from sqlalchemy import case, delete, func, select
from sqlalchemy.orm import Session

from broker.service.store.tables import ApiToken, Budget, Job, ProjectBudget, UsageRow, utcnow
from broker.states import ACTIVE_STATE_VALUES

log = logging.getLogger(__name__)

__all__ = ["budget_rows", "project_budget_rows", "put_budget", "delete_budget", "cloud_spent", "cloud_committed",
           "team_known"]


def budget_rows(s: Session, team: str | None = None) -> list[Budget]:
    """Inside ``s``: the budgets, by team (only ``team``'s when given)."""
    q = select(Budget).order_by(Budget.team)
    if team is not None:
        q = q.where(Budget.team == team)
    return list(s.execute(q).scalars())


def project_budget_rows(s: Session, team: str | None = None, project: str | None = None) -> list[ProjectBudget]:
    """Inside ``s``: the project budgets, by team then project (only ``team``'s, ``project``'s when given)."""
    q = select(ProjectBudget).order_by(ProjectBudget.team, ProjectBudget.project)
    if team is not None:
        q = q.where(ProjectBudget.team == team)
    if project is not None:
        q = q.where(ProjectBudget.project == project)
    return list(s.execute(q).scalars())


def put_budget(s: Session, team: str, cap_usd: float, alert_fraction: float, now: datetime, by: str,
               project: str | None = None) -> Budget | ProjectBudget:
    """Inside ``s``: set ``team``'s cap and alert fraction, or with ``project`` that project's (insert or update; a
    changed cap or fraction clears the month's raised alert so a new threshold can fire). Returns the row."""
    row = s.get(Budget, team) if project is None else s.get(ProjectBudget, (team, project))
    if row is None:
        kw = {} if project is None else {"project": project}
        row = (Budget if project is None else ProjectBudget)(
            team=team, cap_usd=cap_usd, alert_fraction=alert_fraction, alerted_month=None, updated_at=now,
            updated_by=by, **kw)
        s.add(row)
    else:
        if (row.cap_usd, row.alert_fraction) != (cap_usd, alert_fraction):
            row.alerted_month = None
        row.cap_usd, row.alert_fraction, row.updated_at, row.updated_by = cap_usd, alert_fraction, now, by
    s.flush()
    return row


def team_known(s: Session, team: str) -> bool:
    """Inside ``s``: whether the broker knows ``team``: a token of it (revoked or expired too), a job of it, or a
    budget of it already."""
    for q in (select(ApiToken.id).where(ApiToken.team == team), select(Job.id).where(Job.team == team),
              select(Budget.team).where(Budget.team == team),
              select(ProjectBudget.team).where(ProjectBudget.team == team)):
        if s.execute(q.limit(1)).first() is not None:
            return True
    return False


def delete_budget(s: Session, team: str, project: str | None = None) -> bool:
    """Inside ``s``: remove ``team``'s budget (with ``project``: that project's only); ``False`` when it had none."""
    if project is None:
        return s.execute(delete(Budget).where(Budget.team == team)).rowcount > 0
    return s.execute(delete(ProjectBudget).where(ProjectBudget.team == team,
                                                 ProjectBudget.project == project)).rowcount > 0


def cloud_spent(s: Session, start: datetime, end: datetime, teams: list[str] | None = None, *,
                by_project: bool = False) -> dict:
    """Inside ``s``: per team (``by_project``: per ``(team, project)``), ``(billed USD, lines with an unknown
    cost)`` of the ledger's cloud lines (provider not ``onprem``) whose window starts in ``[start, end)`` (UTC).
    Only ``teams``' when given."""
    keys = (UsageRow.team, UsageRow.project) if by_project else (UsageRow.team,)
    q = (select(*keys, func.coalesce(func.sum(UsageRow.billed_usd), 0.0),
                func.sum(case((UsageRow.billed_usd.is_(None), 1), else_=0)))
         .where(UsageRow.provider != "onprem", UsageRow.start >= start, UsageRow.start < end)
         .group_by(*keys))
    if teams is not None:
        q = q.where(UsageRow.team.in_(teams))
    return {(tuple(row[:-2]) if by_project else row[0]): (float(row[-2]), int(row[-1] or 0)) for row in s.execute(q)}


def cloud_committed(s: Session, teams: list[str] | None = None, *, by_project: bool = False,
                    now: datetime | None = None) -> dict:
    """Inside ``s``: per team (``by_project``: per ``(team, project)``, the project of the job's spec),
    ``(USD, attempts)`` committed to cloud attempts not metered yet: the jobs in an
    active state (provisioning, starting, running) placed on a cloud offer, each counted at the ``dollars_usd``
    of the decision that placed it (the planner's estimate of the whole attempt: price x expected runtime,
    the spot rework and the billing minimum included), or, for an attempt running longer than the decision's
    ``runtime_s``, at that estimate x ``elapsed / runtime_s`` (the estimate's rate over the time it has run:
    ``max(estimate, elapsed)``, so a team cannot pass its cap by under-estimating; ``elapsed = now -
    started_at``, ``now`` default the clock). E.g. 2.00 USD for a 600 s runtime, running for 1,800 s: 6.00 USD.
    The ledger writes the attempt's actual lines in the transaction that ends it, which also leaves the active
    states, so an attempt is never counted twice."""
    now = now or utcnow()
    q = select(Job.team, Job.placement, Job.decision, Job.spec, Job.started_at).where(
        Job.state.in_(ACTIVE_STATE_VALUES))
    if teams is not None:
        q = q.where(Job.team.in_(teams))
    out: dict = {}
    for team, placement, decision, spec, started_at in s.execute(q):
        if (placement or {}).get("kind") != "cloud":
            continue
        option = ((decision or {}).get("option") or {}) if isinstance(decision, dict) else {}
        raw = option.get("dollars_usd")
        try:
            usd = float(raw)
        except (TypeError, ValueError):
            usd = math.nan
        if not math.isfinite(usd):  # a decision record without a usable estimate must not stop the planning cycle
            log.warning("team %s: an active cloud job's decision has no finite dollars_usd (%r): committed as 0, "
                        "the ledger's lines count it when the attempt ends", team, raw)
            usd = 0.0
        try:
            runtime_s = float(option.get("runtime_s"))
        except (TypeError, ValueError):
            runtime_s = math.nan
        if started_at is not None and math.isfinite(runtime_s) and runtime_s > 0:
            if started_at.tzinfo is None:  # SQLite gives naive UTC
                started_at = started_at.replace(tzinfo=timezone.utc)
            usd *= max(1.0, (now - started_at).total_seconds() / runtime_s)
        key = (team, (spec or {}).get("project")) if by_project else team
        usd0, n0 = out.get(key, (0.0, 0))
        out[key] = (usd0 + usd, n0 + 1)
    return out
