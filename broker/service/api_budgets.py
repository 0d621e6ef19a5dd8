"""The budget routes of the HTTP API (added to :func:`broker.service.api.create_app`; issue #12 item 4).

::

    GET    /v1/budgets?team=&project=&projects=   admin: every team's budget state (or ``team``'s); other tokens:
                                    their team's (403 for ``team`` of another team). ``projects=true`` (or a
                                    ``project``): the project budgets instead
    GET    /v1/budgets/{team}?project=    one team's (or that project's) state (admin, or a token of that team)
    PUT    /v1/budgets/{team}?project=&new_team=    BudgetRequest -> BudgetState: set the monthly cloud cap (a
                                    team's: admin only; a project's: admin or a team admin of that team). The cap
                                    is 0 (no cloud) or 0.01 to 1e12 USD; a team without a token, job or budget is
                                    refused (422 naming team: a typo) unless ``new_team=true``
    DELETE /v1/budgets/{team}?project=    -> 204 (same rights as PUT): its cloud spend is unlimited again (a
                                    project's team budget, if any, still holds it)

``project`` is optional everywhere, so the team-budget calls are unchanged (no new route).

The state's figures (spent, committed, remaining, forecast, alert, capped) are defined in
:mod:`broker.service.budgets`. Errors: 403 (not an admin for a change; a
team token's ``GET /v1/budgets?team=`` of another team), 404 (no budget, or another team's for
a team token), 422 naming the field.
"""

from typing import Annotated

from fastapi import FastAPI, HTTPException, Path, Query, Response
from fastapi.exceptions import RequestValidationError

from broker.model import TEAM_RE
from broker.schemas import ErrorBody
from broker.service.budgets import BudgetError, BudgetRequest, BudgetState, budget_states, remove_budget, set_budget
from broker.service.store.core import JobStore
from broker.service.store.tables import utcnow
from broker.service.tokens import readable_team

__all__ = ["register"]

_ERR = {401: {"model": ErrorBody, "description": "missing, unknown, revoked or expired token"},
        403: {"model": ErrorBody, "description": "this token may not do this (changes need an admin token)"}}
_ONE = {**_ERR, 404: {"model": ErrorBody, "description": "no budget for this team visible to the caller"}}
_TEAM = Path(min_length=1, max_length=63, pattern=TEAM_RE.pattern, description="The team")
_PROJECT = Query(min_length=1, max_length=63, pattern=TEAM_RE.pattern,
                 description="A project of the team (the job spec's ``project``): its budget rather than the team's")


def register(app: FastAPI, store: JobStore, Caller) -> None:
    """Add the budget routes to ``app``; ``Caller`` is the API's authenticated-principal dependency."""

    def not_found(team: str, project: str | None = None) -> HTTPException:
        what = f"team={team!r}" if project is None else f"project={project!r} of team={team!r}"
        return HTTPException(404, f"{what}: no budget (its cloud spend is unlimited by it)"
                                  " or not your team")

    def may_change(who, what: str, team: str, project: str | None) -> None:
        """A team budget: admins only. A project budget: admins and the team's own team admins."""
        if who.admin or (project is not None and who.kind == "team-admin" and who.team == team):
            return
        need = "an admin token" if project is None else f"an admin or a team-admin token of team {team!r}"
        raise HTTPException(403, f"{what} needs {need} (yours is {who.kind} of team {who.team!r})")

    @app.get("/v1/budgets", response_model=list[BudgetState], tags=["budgets"], responses=_ERR)
    def list_budgets(who: Caller,
                     team: Annotated[str | None, Query(min_length=1, max_length=63, pattern=TEAM_RE.pattern,
                                                       description="Only this team (admins and finance: any; "
                                                                   "other tokens: their own, 403 for another)")] = None,
                     project: Annotated[str | None, _PROJECT] = None,
                     projects: Annotated[bool, Query(description="The project budgets (by team, project) instead "
                                                                 "of the team budgets")] = False
                     ) -> list[BudgetState]:
        """Budget states by team this month (UTC): an admin or finance token sees every team's (or ``team``'s),
        any other token its own team's only (403 when its ``team`` names another team). With ``projects=true`` or a ``project``: the project budgets, by
        team then project."""
        team = readable_team(who, team, who.all_finance)  # as GET /v1/jobs?team= and the usage routes
        with store.session() as s:
            return budget_states(s, utcnow(), team, project, projects=projects)

    @app.get("/v1/budgets/{team}", response_model=BudgetState, tags=["budgets"], responses=_ONE)
    def get_budget(team: Annotated[str, _TEAM], who: Caller,
                   project: Annotated[str | None, _PROJECT] = None) -> BudgetState:
        """One team's (or, with ``project``, one project's) budget state this month: cap, spent, committed,
        remaining, forecast to month end, alert."""
        if not who.all_finance and team != who.team:
            raise not_found(team, project)
        with store.session() as s:
            out = budget_states(s, utcnow(), team, project)
        if not out:
            raise not_found(team, project)
        return out[0]

    @app.put("/v1/budgets/{team}", response_model=BudgetState, tags=["budgets"],
             responses={**_ERR, 422: {"model": ErrorBody,
                                      "description": "bad team, project, cap_usd or alert_fraction"}})
    def put_budget(team: Annotated[str, _TEAM], body: BudgetRequest, who: Caller,
                   project: Annotated[str | None, _PROJECT] = None,
                   new_team: Annotated[bool, Query(description="Budget a team the broker does not know yet (no "
                                                               "token, job or budget of it); without it such a "
                                                               "team is refused (422 naming team): a typo")] = False
                   ) -> BudgetState:
        """Set a team's (or, with ``project``, a project's) monthly cloud cap (USD) and soft alert fraction
        (a team's: admin only; a project's: admin or that team's team admin; audited ``budget.set``). The next
        planning cycle applies it: no new cloud spend past the cap."""
        may_change(who, "setting a budget", team, project)
        try:
            return set_budget(store, team, body.cap_usd, body.alert_fraction, project=project, actor=who,
                              require_known_team=not new_team)
        except BudgetError as e:
            where = "path" if e.field == "team" else "query" if e.field == "project" else "body"
            raise RequestValidationError([{"type": "value_error", "loc": (where, e.field), "input": e.value,
                                           "msg": str(e)}]) from None

    @app.delete("/v1/budgets/{team}", status_code=204, response_class=Response, tags=["budgets"], responses=_ONE)
    def delete_budget(team: Annotated[str, _TEAM], who: Caller,
                      project: Annotated[str | None, _PROJECT] = None) -> Response:
        """Remove a team's (or, with ``project``, a project's) budget (same rights as setting it; audited
        ``budget.delete``): its cloud spend is no longer capped by it."""
        may_change(who, "removing a budget", team, project)
        if not remove_budget(store, team, project=project, actor=who):
            raise not_found(team, project)
        return Response(status_code=204)
