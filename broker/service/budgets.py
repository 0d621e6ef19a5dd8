"""Team and project budgets (issue #12 item 4): a monthly cloud cap per team, optionally per (team, project), its
state, and what the planner may still spend.

**What a budget covers.** New *cloud* spend, USD, per calendar month (UTC). On-prem capacity is paid for
whether it is busy or not, so a capped team keeps running on-prem: a hard cap only stops new cloud spend,
and the team's jobs wait for on-prem capacity (or run late, past their deadline); none is dropped.

**Project budgets.** A team's project (the job spec's ``project``, :class:`broker.model.JobSpec`, which the usage
ledger records on every line) may have its own cap (``PUT /v1/budgets/{team}?project=P``, ``fedbroker budgets
set TEAM --project P``), with the same figures and semantics, counted over the lines and jobs of that project
only. Jobs without a project count in their team's budget and in no project's. Both caps hold: a job of a
budgeted project of a budgeted team may spend on the cloud only what the smaller of the two has left, and each
cloud decision is charged to both. So a project's cap stops new cloud spend for that project's jobs only (the
team's other projects still burst), while the team's cap still holds every project of the team. The decision's
explanation starts with "project budget cap reached: project P of team T ..." or "team budget cap reached:
team T ..." for the cap that held it. Setting and removing a project budget: an admin, or a team admin of
that team; a team budget: an admin only.

**State** of a team's (or project's) budget in a month (:class:`BudgetState`, ``GET /v1/budgets``, ``fedbroker budgets``):

* ``spent_usd`` — billed USD of the usage ledger's cloud lines (:mod:`broker.usage`, provider not
  ``onprem``: the team's instances, their boot disks and their idle time) whose window starts in the month.
  A line whose cost is unknown counts 0 and is counted in ``unpriced_lines`` (flagged, never hidden).
* ``committed_usd`` — cloud attempts not metered yet (jobs provisioning, starting or running on a cloud
  offer), each at the ``dollars_usd`` of the decision that placed it: the planner's own estimate of the
  whole attempt (offer price x expected runtime, the spot rework and the billing minimum included,
  :meth:`broker.planner.core.PlannerContext.cloud_estimates`). That figure rather than a fresh price x
  runtime because it is exactly what the planner charged against the budget when it decided, so the
  next cycle sees the same commitment the last one made. An attempt running past the decision's
  ``runtime_s`` counts ``max(estimate, elapsed)``: the estimate x ``elapsed / runtime_s`` (2 USD estimated
  for 600 s, running for 1,800 s: 6 USD), so under-estimating does not get a team past its cap. The
  ledger's lines replace it in the transaction that ends the attempt
  (:func:`broker.service.store.budgets.cloud_committed`).
* ``remaining_usd = cap_usd - spent_usd - committed_usd`` (may be negative when bills beat estimates).
* ``forecast_usd`` — to month end, linear: ``spent + committed + spent / elapsed x left`` (the month-to-date
  rate of metered spend carried to the month's end; ``elapsed`` and ``left`` in seconds of the month;
  committed counted once, as already spent). Example: December (31 days), on the 11th at 00:00 UTC
  with 100 USD spent and 20 committed: 120 + 100 / 10 d x 21 d = 330 USD.
* ``alert`` — the soft threshold: ``spent + committed >= alert_fraction x cap``. The first planning cycle
  that sees it in a month logs a warning and writes one ``budget.alert`` audit event (``alerted_month``
  keeps it to once a month; changing the cap or the fraction re-arms it).
* ``capped`` — ``remaining_usd <= 0``: the hard cap is reached.

**The hard cap in the planner.** Each cycle passes ``remaining_usd`` per budgeted team to the planner as
:attr:`broker.planner.core.PlannerConfig.team_budget_usd` and per budgeted project as
:attr:`~broker.planner.core.PlannerConfig.project_budget_usd` (the planner's one budget rule,
:mod:`broker.planner.federated`): a cloud option is feasible only if its ``dollars_usd`` fits in what is
left, and each cloud decision takes its cost off before the next job of the team is decided. So the
cloud decisions of one cycle together never exceed what was left at its start, and the next cycle starts
from ``cap - spent - committed`` with those decisions committed. Overshoot bound: committed estimates
never take a team past its cap; the ledger can exceed the cap only by what the attempts decided before
the cap was reached cost beyond their estimates (runs longer than estimated), never by a further
cycle's decisions. The same bound holds for each project's cap. A blocked job's explanation starts with
"team budget cap reached: ..." or "project budget cap reached: ...".
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import datetime, timezone

from pydantic import BaseModel, ConfigDict, Field, field_validator

from broker.model import TEAM_RE

#: a project name: the job spec's ``project`` pattern (:class:`broker.model.JobSpec`), the team name's
PROJECT_RE = TEAM_RE

__all__ = ["DEFAULT_ALERT_FRACTION", "MAX_CAP_USD", "MIN_CAP_USD", "check_cap", "PROJECT_RE", "BudgetError", "BudgetRequest", "BudgetState", "month_bounds",
           "forecast_usd", "budget_states", "planner_budgets", "set_budget", "remove_budget"]

log = logging.getLogger("fedbroker.budgets")

#: the largest cap, USD per month: 1e12 (a trillion dollars: above any team's cloud bill, and far inside what a
#: float holds to the cent); a larger one is a typo (``--cap 1e308`` printed a 60-digit number)
MAX_CAP_USD = 1e12
#: the smallest cap above 0, USD: a cent (0 itself means "no cloud at all")
MIN_CAP_USD = 0.01

#: the soft alert at 80 % of the cap unless the admin says otherwise (a common default of cloud budget alerts,
#: e.g. the AWS Budgets console's suggested threshold)
DEFAULT_ALERT_FRACTION = 0.8


class BudgetError(ValueError):
    """Bad budget input: names the field and the value."""

    def __init__(self, field: str, value, msg: str):
        super().__init__(f"{field}={value!r}: {msg}")
        self.field, self.value = field, value


class BudgetRequest(BaseModel):
    """``PUT /v1/budgets/{team}``: the team's monthly cloud cap and soft alert fraction."""

    model_config = ConfigDict(extra="forbid")

    cap_usd: float = Field(..., ge=0, le=MAX_CAP_USD, allow_inf_nan=False,
                           description="Hard cap on the team's cloud spend per calendar month (UTC), USD; "
                                       "0 = no cloud at all, else from 0.01 (a cent) to 1e12")

    @field_validator("cap_usd")
    @classmethod
    def _cap(cls, v: float) -> float:
        check_cap(v)
        return v
    alert_fraction: float = Field(DEFAULT_ALERT_FRACTION, gt=0, le=1, allow_inf_nan=False,
                                  description="Soft alert when spent + committed reaches this fraction of the cap")


class BudgetState(BaseModel):
    """A team's (or, with ``project``, a project's) budget in the month of ``as_of`` (module docstring for each
    figure). USD throughout."""

    team: str
    project: str | None = Field(None, description="the project of a project budget; null: the team's own budget")
    month: str = Field(description="YYYY-MM, UTC")
    cap_usd: float
    alert_fraction: float
    spent_usd: float = Field(description="billed USD of the ledger's cloud lines starting this month")
    unpriced_lines: int = Field(description="cloud lines of the month whose cost is unknown (counted 0, flagged)")
    committed_usd: float = Field(description="estimated USD of cloud attempts not metered yet")
    committed_attempts: int
    remaining_usd: float = Field(description="cap - spent - committed (negative past the cap)")
    forecast_usd: float = Field(description="spent + committed + spent / elapsed x time left in the month")
    alert: bool = Field(description="spent + committed >= alert_fraction x cap")
    capped: bool = Field(description="remaining <= 0: no new cloud spend this month")
    as_of: datetime
    updated_at: datetime
    updated_by: str


def month_bounds(now: datetime) -> tuple[datetime, datetime]:
    """The calendar month (UTC) holding ``now``: ``(first instant, first instant of the next month)``."""
    if now.tzinfo is None:
        raise BudgetError("now", now.isoformat(), "give an aware datetime (UTC)")
    now = now.astimezone(timezone.utc)
    start = datetime(now.year, now.month, 1, tzinfo=timezone.utc)
    end = datetime(now.year + (now.month == 12), now.month % 12 + 1, 1, tzinfo=timezone.utc)
    return start, end


def forecast_usd(spent: float, committed: float, start: datetime, end: datetime, now: datetime) -> float:
    """Spend forecast to month end, USD: ``spent + committed + spent / elapsed x left`` (module docstring);
    at the month's first instant (nothing elapsed) the rate is unknown and the forecast is ``spent + committed``."""
    elapsed = (now - start).total_seconds()
    left = max((end - now).total_seconds(), 0.0)
    rate = spent / elapsed if elapsed > 0 else 0.0
    return spent + committed + rate * left


def check_cap(cap_usd) -> None:
    """Raises :class:`BudgetError` naming ``cap_usd`` unless it is 0 (no cloud at all) or a finite number of USD
    from :data:`MIN_CAP_USD` (a cent) to :data:`MAX_CAP_USD` (1e12)."""
    if isinstance(cap_usd, bool) or not isinstance(cap_usd, (int, float)) or not math.isfinite(cap_usd) or cap_usd < 0:
        raise BudgetError("cap_usd", cap_usd, "must be a finite number of USD >= 0")
    if cap_usd > MAX_CAP_USD:
        raise BudgetError("cap_usd", cap_usd, f"above the largest cap, {MAX_CAP_USD:.0e} USD a month (a typo?)")
    if 0 < cap_usd < MIN_CAP_USD:
        raise BudgetError("cap_usd", cap_usd, "below a cent: give 0 for no cloud at all, or at least 0.01 USD")


def _check_team(team: str, project: str | None = None) -> None:
    if not isinstance(team, str) or not TEAM_RE.match(team):
        raise BudgetError("team", team, "not a team name (letters, digits, _ . -; up to 63; starts with a letter "
                                        "or digit)")
    if project is not None and (not isinstance(project, str) or not PROJECT_RE.match(project)):
        raise BudgetError("project", project, "not a project name (letters, digits, _ . -; up to 63; starts with a "
                                              "letter or digit)")


def _state(row, spent: tuple[float, int], committed: tuple[float, int], now: datetime,
           bounds: tuple[datetime, datetime]) -> BudgetState:
    s_usd, unpriced = spent
    c_usd, n = committed
    start, end = bounds
    used = s_usd + c_usd
    remaining = row.cap_usd - used
    # a 0 cap (no cloud at all) alerts on the first cloud spend, not at 0 >= 0.8 x 0 with nothing spent
    return BudgetState(team=row.team, project=getattr(row, "project", None), month=f"{start:%Y-%m}", cap_usd=row.cap_usd, alert_fraction=row.alert_fraction,
                       spent_usd=s_usd, unpriced_lines=unpriced, committed_usd=c_usd, committed_attempts=n,
                       remaining_usd=remaining, forecast_usd=forecast_usd(s_usd, c_usd, start, end, now),
                       alert=used >= row.alert_fraction * row.cap_usd and (row.cap_usd > 0 or used > 0),
                       capped=remaining <= 0,
                       as_of=now, updated_at=row.updated_at, updated_by=row.updated_by)


def budget_states(s, now: datetime, team: str | None = None, project: str | None = None, *,
                  projects: bool = False) -> list[BudgetState]:
    """Inside session ``s``: the state at ``now`` (UTC) of every team budget, by team (only ``team``'s when given);
    with ``projects`` (or a ``project`` given) of every project budget instead, by team then project (only
    ``team``'s and ``project``'s when given)."""
    from broker.service.store import budgets as rows

    bounds = month_bounds(now)
    by_project = projects or project is not None
    budgets = rows.project_budget_rows(s, team, project) if by_project else rows.budget_rows(s, team)
    if not budgets:
        return []
    teams = sorted({b.team for b in budgets})
    spent = rows.cloud_spent(s, bounds[0], bounds[1], teams, by_project=by_project)
    committed = rows.cloud_committed(s, teams, by_project=by_project, now=now)
    keys = [(b.team, b.project) if by_project else b.team for b in budgets]
    return [_state(b, spent.get(k, (0.0, 0)), committed.get(k, (0.0, 0)), now, bounds) for b, k in zip(budgets, keys)]


def planner_budgets(s, now: datetime) -> tuple[dict[str, float], dict[str, dict[str, float]], list[BudgetState]]:
    """Inside session ``s`` (the planning cycle's): ``(team -> remaining USD`` for
    :attr:`PlannerConfig.team_budget_usd`, ``team -> project -> remaining USD`` for
    :attr:`PlannerConfig.project_budget_usd`, the states: the teams' then the projects')``. Raises the month's
    soft alert of each team and project that reached it (a warning in the log and one ``budget.alert`` audit
    event, in ``s``'s transaction; a project's names it in the event's detail)."""
    from broker.service.store.tables import Budget, ProjectBudget
    from broker.service.store.tokens import audit

    states = budget_states(s, now) + budget_states(s, now, projects=True)
    for st in states:
        if st.alert:
            row = s.get(Budget, st.team) if st.project is None else s.get(ProjectBudget, (st.team, st.project))
            if row is not None and row.alerted_month != st.month:
                row.alerted_month = st.month
                who = f"team {st.team}" if st.project is None else f"project {st.project} of team {st.team}"
                if st.cap_usd > 0:
                    log.warning("%s: cloud budget alert for %s: spent %.2f + committed %.2f USD = %.0f %% of the "
                                "%.2f USD cap (alert at %.0f %%)", who, st.month, st.spent_usd, st.committed_usd,
                                100.0 * (st.spent_usd + st.committed_usd) / st.cap_usd, st.cap_usd,
                                100.0 * st.alert_fraction)
                else:  # a 0 cap: a share of it means nothing (cb5ea98 logged "inf %")
                    log.warning("%s: cloud budget alert for %s: spent %.2f + committed %.2f USD against a 0 USD cap "
                                "(no cloud allowed)", who, st.month, st.spent_usd, st.committed_usd)
                detail = {"month": st.month, "cap_usd": st.cap_usd, "spent_usd": st.spent_usd,
                          "committed_usd": st.committed_usd, "alert_fraction": st.alert_fraction}
                if st.project is not None:
                    detail["project"] = st.project
                audit(s, None, "budget.alert", st.team, detail, now=now)
    teams: dict[str, float] = {}
    projects: dict[str, dict[str, float]] = {}
    for st in states:
        if st.project is None:
            teams[st.team] = st.remaining_usd
        else:
            projects.setdefault(st.team, {})[st.project] = st.remaining_usd
    return teams, projects, states


def set_budget(store, team: str, cap_usd: float, alert_fraction: float = DEFAULT_ALERT_FRACTION, *,
               project: str | None = None, actor=None, now: datetime | None = None,
               require_known_team: bool = False) -> BudgetState:
    """Set ``team``'s (with ``project``: that project's) monthly cloud cap (USD) and soft alert fraction, audited
    as ``budget.set`` (a project's names it in the detail); returns the state.

    Raises :class:`BudgetError` naming the field for a bad team or project, a cap that is not 0 or from 0.01 to
    1e12 USD (:func:`check_cap`), a fraction outside (0, 1], or, with ``require_known_team`` (the API's and
    the CLI's default), a team the broker does not know: no token, no job and no budget of it
    (:func:`broker.service.store.budgets.team_known`; a typo'd team would be capped for nothing). A team
    budgeted before its first token is set with ``require_known_team=False`` (API ``?new_team=true``,
    ``fedbroker budgets set --new-team``)."""
    from broker.service.store import budgets as rows
    from broker.service.store.tables import utcnow
    from broker.service.store.tokens import audit

    _check_team(team, project)
    check_cap(cap_usd)
    if (isinstance(alert_fraction, bool) or not isinstance(alert_fraction, (int, float))
            or not (0 < alert_fraction <= 1)):
        raise BudgetError("alert_fraction", alert_fraction, "must be in (0, 1]")
    now = now or utcnow()
    with store.session() as s:
        if require_known_team and not rows.team_known(s, team):
            raise BudgetError("team", team, "no token, job or budget of this team: a typo? (to budget a team before "
                                            "its first token: new_team=true, fedbroker budgets set --new-team)")
        rows.put_budget(s, team, float(cap_usd), float(alert_fraction), now, getattr(actor, "team", "") or "database",
                        project)
        detail = {"cap_usd": float(cap_usd), "alert_fraction": float(alert_fraction)}
        if project is not None:
            detail["project"] = project
        audit(s, actor, "budget.set", team, detail, now=now)
        s.flush()
        return budget_states(s, now, team, project)[0]


def remove_budget(store, team: str, *, project: str | None = None, actor=None, now: datetime | None = None) -> bool:
    """Remove ``team``'s budget (with ``project``: that project's only; the team's own budget, if any, still
    holds it), audited as ``budget.delete``; ``False`` when it had none. Raises :class:`BudgetError` naming the
    field for a bad team or project."""
    from broker.service.store import budgets as rows
    from broker.service.store.tokens import audit

    _check_team(team, project)
    with store.session() as s:
        gone = rows.delete_budget(s, team, project)
        if gone:
            audit(s, actor, "budget.delete", team, {} if project is None else {"project": project}, now=now)
        return gone
