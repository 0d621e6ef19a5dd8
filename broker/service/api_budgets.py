"""The budget routes of the HTTP API (added to :func:`broker.service.api.create_app`; issue #12 item 4).

::

    GET    /v1/budgets?team=        admin: every team's budget state (or ``team``'s); other tokens: their team's
    GET    /v1/budgets/{team}       one team's state (admin, or a token of that team)
    PUT    /v1/budgets/{team}       BudgetRequest -> BudgetState (admin only): set the monthly cloud cap
    DELETE /v1/budgets/{team}       -> 204 (admin only): the team's cloud spend is unlimited again

The state's figures (spent, committed, remaining, forecast, alert, capped) are defined in
:mod:`broker.service.budgets`. Errors: 403 (not an admin for a change), 404 (no budget, or another team's for
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

__all__ = ["register"]

_ERR = {401: {"model": ErrorBody, "description": "missing, unknown, revoked or expired token"},
        403: {"model": ErrorBody, "description": "this token may not do this (changes need an admin token)"}}
_ONE = {**_ERR, 404: {"model": ErrorBody, "description": "no budget for this team visible to the caller"}}
_TEAM = Path(min_length=1, max_length=63, pattern=TEAM_RE.pattern, description="The team")


def register(app: FastAPI, store: JobStore, Caller) -> None:
    """Add the budget routes to ``app``; ``Caller`` is the API's authenticated-principal dependency."""

    def not_found(team: str) -> HTTPException:
        return HTTPException(404, f"team={team!r}: no budget (its cloud spend is unlimited)"
                                  " or not your team")

    def admin_only(who, what: str) -> None:
        if not who.admin:
            raise HTTPException(403, f"{what} needs an admin token (yours is {who.kind} of team {who.team!r})")

    @app.get("/v1/budgets", response_model=list[BudgetState], tags=["budgets"], responses=_ERR)
    def list_budgets(who: Caller,
                     team: Annotated[str | None, Query(min_length=1, max_length=63, pattern=TEAM_RE.pattern,
                                                       description="Only this team (admins)")] = None
                     ) -> list[BudgetState]:
        """Budget states by team this month (UTC): an admin or finance token sees every team's (or ``team``'s),
        any other token its own team's only."""
        if not who.all_finance:
            team = who.team
        with store.session() as s:
            return budget_states(s, utcnow(), team)

    @app.get("/v1/budgets/{team}", response_model=BudgetState, tags=["budgets"], responses=_ONE)
    def get_budget(team: Annotated[str, _TEAM], who: Caller) -> BudgetState:
        """One team's budget state this month: cap, spent, committed, remaining, forecast to month end, alert."""
        if not who.all_finance and team != who.team:
            raise not_found(team)
        with store.session() as s:
            out = budget_states(s, utcnow(), team)
        if not out:
            raise not_found(team)
        return out[0]

    @app.put("/v1/budgets/{team}", response_model=BudgetState, tags=["budgets"],
             responses={**_ERR, 422: {"model": ErrorBody, "description": "bad team, cap_usd or alert_fraction"}})
    def put_budget(team: Annotated[str, _TEAM], body: BudgetRequest, who: Caller) -> BudgetState:
        """Set a team's monthly cloud cap (USD) and soft alert fraction (admin only; audited ``budget.set``).
        The next planning cycle applies it: no new cloud spend past the cap."""
        admin_only(who, "setting a budget")
        try:
            return set_budget(store, team, body.cap_usd, body.alert_fraction, actor=who)
        except BudgetError as e:
            raise RequestValidationError([{"type": "value_error", "loc": ("body", e.field), "input": e.value,
                                           "msg": str(e)}]) from None

    @app.delete("/v1/budgets/{team}", status_code=204, response_class=Response, tags=["budgets"], responses=_ONE)
    def delete_budget(team: Annotated[str, _TEAM], who: Caller) -> Response:
        """Remove a team's budget (admin only; audited ``budget.delete``): its cloud spend is unlimited again."""
        admin_only(who, "removing a budget")
        if not remove_budget(store, team, actor=who):
            raise not_found(team)
        return Response(status_code=204)
