"""``fedbroker budgets``: teams' (and projects') monthly cloud budgets (issue #12 item 4), on the broker's database.

* ``fedbroker budgets set TEAM --cap USD [--alert 0.8] [--project P] [--new-team]`` — set the hard cap (USD per
  calendar month, UTC: 0 for no cloud at all, else 0.01 to 1e12) and the soft alert fraction of the team, or of
  its project ``P`` (audited ``budget.set``; the next planning cycle applies it). A team the broker does not know
  (no token, job or budget of it: a typo) is refused unless ``--new-team``;
* ``fedbroker budgets list [--projects]`` — every team's (``--projects``: every project's) state this month: cap,
  spent, committed, remaining, forecast, alert;
* ``fedbroker budgets show TEAM [--project P]`` — one team's (or project's) state;
* ``fedbroker budgets delete TEAM [--project P]`` — its cloud spend is no longer capped by that budget.

Like ``fedbroker cost`` these read the broker's database (``--config``: the settings' ``database_url``), so
they are the operator's tool on the broker's host; over HTTP the same is ``/v1/budgets`` (README). The figures
are defined in :mod:`broker.service.budgets`. Exit 2 for bad input (naming the option), 1 for a team (or
project) without a budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from broker.cli.cloud import ConfigOpt, _database, _settings
from broker.cli.console import JsonOpt, current_console, echo_json, fail
from broker.money import decimals_for, figure_text

__all__ = ["budgets_app", "register"]

budgets_app = typer.Typer(no_args_is_help=True,
                          help="Teams' monthly cloud budgets: a hard cap and a soft alert, with spend and forecast.")


def _store(config: Optional[Path]):
    from broker.service.store.core import JobStore

    st = _settings(config)
    return st, JobStore.from_settings(st)


_ProjectOpt = typer.Option(None, "--project", help="A project of the team (the job spec's project): its budget "
                                                     "rather than the team's.")


def _who(team: str, project: Optional[str]) -> str:
    return f"team {team!r}" if project is None else f"project {project!r} of team {team!r}"


def _table(states) -> Table:
    tab = Table(title=f"cloud budgets, {states[0].month} (UTC), USD" if states else "cloud budgets")
    projects = any(b.project is not None for b in states)
    for col in ("team", *(("project",) if projects else ()), "cap", "spent", "committed", "remaining", "forecast",
                "alert at", "state"):
        tab.add_column(col, justify="left" if col in ("team", "project", "state") else "right")
    money = ("cap_usd", "spent_usd", "committed_usd", "remaining_usd", "forecast_usd")
    places = decimals_for(getattr(b, f) for b in states for f in money)  # one number of decimals (broker.money)
    cap, spent, committed, remaining, forecast = ([figure_text(getattr(b, f), places) for b in states] for f in money)
    for i, b in enumerate(states):
        state = "CAPPED: no new cloud spend" if b.capped else ("alert" if b.alert else "ok")
        if b.unpriced_lines:
            state += f" ({b.unpriced_lines} unpriced line(s))"
        tab.add_row(escape(b.team), *((escape(b.project or "-"),) if projects else ()), cap[i], spent[i],
                    f"{committed[i]} ({b.committed_attempts})", remaining[i], forecast[i],
                    f"{100 * b.alert_fraction:.0f} %", state)
    return tab


@budgets_app.command("set")
def set_cmd(team: str = typer.Argument(..., help="The team."),
            cap: float = typer.Option(..., "--cap", help="Hard cap on the team's cloud spend per month (UTC), USD."),
            alert: float = typer.Option(0.8, "--alert", help="Soft alert at this fraction of the cap, (0, 1]."),
            project: Optional[str] = _ProjectOpt,
            new_team: bool = typer.Option(False, "--new-team", help="Budget a team the broker does not know yet "
                                                                    "(no token, job or budget of it)."),
            config: Optional[Path] = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Set TEAM's (or its PROJECT's) monthly cloud cap (0: no cloud; else 0.01 to 1e12 USD) and soft alert; prints
    the budget's state. A team with no token, job or budget is refused (a typo) unless --new-team."""
    from broker.service.budgets import BudgetError, set_budget

    st, store = _store(config)
    try:
        with _database(st):
            b = set_budget(store, team, cap, alert, project=project, require_known_team=not new_team)
    except BudgetError as e:
        fail(str(e).replace("cap_usd=", "--cap=").replace("alert_fraction=", "--alert=")
             .replace("project=", "--project=").replace("new_team=true, ", ""), code=2)
    if as_json:
        echo_json(b)
    else:
        current_console().print(_table([b]))


@budgets_app.command("list")
def list_cmd(projects: bool = typer.Option(False, "--projects", help="The project budgets instead of the teams'."),
             config: Optional[Path] = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Every team's (or project's) budget this month: cap, spent, committed, remaining, forecast to month end."""
    from broker.service.budgets import budget_states
    from broker.service.store.tables import utcnow

    st, store = _store(config)
    with _database(st), store.session() as s:
        states = budget_states(s, utcnow(), projects=projects)
    if as_json:
        echo_json(states)
    elif not states:
        current_console().print("no budgets of projects (set one: fedbroker budgets set TEAM --project P)" if projects
                                else "no budgets: every team's cloud spend is unlimited (set one: fedbroker budgets set)")
    else:
        current_console().print(_table(states))


@budgets_app.command("show")
def show_cmd(team: str = typer.Argument(..., help="The team."), project: Optional[str] = _ProjectOpt,
             config: Optional[Path] = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """TEAM's (or its PROJECT's) budget this month; exit 1 when it has none."""
    from broker.service.budgets import budget_states
    from broker.service.store.tables import utcnow

    st, store = _store(config)
    with _database(st), store.session() as s:
        states = budget_states(s, utcnow(), team, project)
    if not states:
        fail(f"{_who(team, project)} has no budget: its cloud spend is not capped by one")
    if as_json:
        echo_json(states[0])
    else:
        current_console().print(_table(states))


@budgets_app.command("delete")
def delete_cmd(team: str = typer.Argument(..., help="The team."), project: Optional[str] = _ProjectOpt,
               config: Optional[Path] = ConfigOpt) -> None:
    """Remove TEAM's (or its PROJECT's) budget: no longer capped by it; exit 1 when it had none."""
    from broker.service.budgets import BudgetError, remove_budget

    st, store = _store(config)
    try:
        with _database(st):
            gone = remove_budget(store, team, project=project)
    except BudgetError as e:
        fail(str(e).replace("project=", "--project="), code=2)
    if not gone:
        fail(f"{_who(team, project)} has no budget")
    what = f"team {escape(team)}" if project is None else f"project {escape(project)} of team {escape(team)}"
    current_console().print(f"{what}: budget removed (cloud spend not capped by it)")


def register(app: typer.Typer) -> None:
    """Add ``fedbroker budgets`` to the main CLI."""
    app.add_typer(budgets_app, name="budgets")
