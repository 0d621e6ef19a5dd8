"""The usage-ledger routes of the HTTP API (added to :func:`broker.service.api.create_app`), issue #12 item 5.

::

    GET /v1/usage/summary?by=&from=&to=&team=   -> UsageSummaryView: USD, GPU-hours, kWh, kgCO2e by
                                                   team | project | provider | region | pool | day
    GET /v1/usage/focus?from=&to=&team=         -> text/csv: the lines as a FOCUS 1.2 dataset (broker.focus)
    GET /v1/usage/savings?from=&to=&team=       -> SavingsView: the jobs' cost against "all on the cheapest
                                                   cloud now" and "on-prem only" (broker.usage.savings, at
                                                   broker.service.ledger.counterfactual_rates)

All read the ledger lines (``usage_records``) that start in ``[from, to)`` (UTC; an instant without a zone is
UTC, a date is its midnight UTC). Who sees what, as ``GET /v1/jobs``: a team token (member, read-only,
team-admin) sees its own team's lines only and gets 403 naming ``team`` for another team; an admin or finance
token sees every team's (or ``team``'s); a node token gets 403. Bad input is a 422 naming the field: ``by`` not a dimension,
``from``/``to`` not an instant, ``to`` not after ``from``.
"""


import io
from datetime import datetime, timezone
from typing import Annotated, Literal

from fastapi import FastAPI, Query, Response
from fastapi.exceptions import RequestValidationError

from broker.focus import FocusAccounts, write_focus_csv
from broker.model import TEAM_RE
from broker.money import exact_float
from broker.schemas import ErrorBody, SavingsView, UsageSummaryView, UsageTotalsView
from broker.service import ledger
from broker.service.settings import BrokerSettings
from broker.service.store import usage as usage_repo
from broker.service.store.core import JobStore
from broker.service.tokens import readable_team
from broker.usage import SUMMARY_DIMENSIONS, savings, total_of

__all__ = ["register", "scope_period", "SKIPPED_HEADER"]

#: the header of ``GET /v1/usage/focus`` that counts the ledger lines left out (cost unknown, flagged)
SKIPPED_HEADER = "X-Fedbroker-Skipped-Lines"

_ERR = {401: {"model": ErrorBody, "description": "missing, unknown, revoked or expired token"},
        403: {"model": ErrorBody, "description": "team is another team (team tokens see their own team only), "
                                                 "or a node token"}}
_TEAM = Query(min_length=1, max_length=63, pattern=TEAM_RE.pattern,
              description="Only this team (default: yours; admins: every team)")
_FROM = Query(alias="from", description="Period start, UTC, inclusive (ISO 8601 instant or date)")
_TO = Query(alias="to", description="Period end, UTC, exclusive (ISO 8601 instant or date)")


def _unprocessable(field: str, value: str, why: str) -> RequestValidationError:
    return RequestValidationError([{"type": "value_error", "loc": ("query", field), "input": value,
                                    "msg": f"{field}={value!r}: {why}"}])


def utc_param(t: datetime, field: str) -> datetime:
    """``t`` as aware UTC (naive: taken as UTC); 422 naming ``field`` when UTC cannot hold it (year 1 or 9999
    with an offset)."""
    try:
        return t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t.astimezone(timezone.utc)
    except OverflowError:
        raise _unprocessable(field, t.isoformat(), "outside the years 1-9999 in UTC") from None


def scope_period(start: datetime, end: datetime) -> tuple[datetime, datetime]:
    """The period ``[start, end)`` as aware UTC (naive: taken as UTC); 422 naming ``to`` when it is not after
    ``from`` (also used by the finance page, :mod:`broker.service.api_finance`)."""
    start, end = utc_param(start, "from"), utc_param(end, "to")
    if end <= start:
        raise _unprocessable("to", end.isoformat(), f"not after from={start.isoformat()!r} (the period is "
                                                    f"[from, to))")
    return start, end


def register(app: FastAPI, store: JobStore, settings: BrokerSettings, Caller) -> None:
    """Add the usage routes to ``app``; ``Caller`` is the API's authenticated-principal dependency. The FOCUS
    export's organisation and billing accounts come from ``settings.finance``."""
    fin = settings.finance
    accounts = FocusAccounts(organisation=fin.organisation, billing_account_id=fin.billing_account_id,
                             billing_account_name=fin.billing_account_name, cloud_accounts=dict(fin.cloud_accounts))

    def scope(who, team: str | None, start: datetime, end: datetime) -> tuple[str | None, datetime, datetime]:
        """The team the caller may read (403 for another team's; admin and finance tokens: any) and the checked UTC
        period."""
        start, end = scope_period(start, end)
        team = readable_team(who, team, who.all_finance)
        return team, start, end

    def records(team: str | None, start: datetime, end: datetime):
        with store.session() as s:
            return usage_repo.usage_rows(s, start=start, end=end, team=team)

    @app.get("/v1/usage/summary", response_model=UsageSummaryView, tags=["usage"], responses=_ERR)
    def usage_summary(who: Caller,
                      start: Annotated[datetime, _FROM], end: Annotated[datetime, _TO],
                      by: Annotated[Literal[SUMMARY_DIMENSIONS], Query(  # type: ignore[valid-type]
                          description="Group by: " + ", ".join(SUMMARY_DIMENSIONS))] = "team",
                      team: Annotated[str | None, _TEAM] = None) -> UsageSummaryView:
        """Cost (USD), GPU-hours, kWh and kgCO2e of the ledger lines that start in ``[from, to)``, grouped
        ``by`` team, project, provider, region, pool or UTC day; unknown figures are counted per group
        (``unpriced_lines``, ...), never summed as 0. Team tokens: their own team only (403 for another); admin
        and finance tokens: every team (or ``team``)."""
        team, start, end = scope(who, team, start, end)
        with store.session() as s:
            groups = usage_repo.usage_totals(s, by, start, end, team=team)
        total = total_of(groups)

        def view(g) -> UsageTotalsView:
            # the SQL sums at broker.money's resolution (no float noise in the JSON)
            return UsageTotalsView(key=g.key, cost_usd=exact_float(g.cost_usd), gpu_hours=exact_float(g.gpu_hours),
                                   energy_kwh=exact_float(g.energy_kwh), carbon_kg=exact_float(g.carbon_kg), lines=g.lines, estimated_lines=g.estimated_lines,
                                   unpriced_lines=g.unpriced_lines, unknown_energy_lines=g.unknown_energy_lines,
                                   unknown_carbon_lines=g.unknown_carbon_lines)

        return UsageSummaryView(by=by, start=start, end=end, team=team, groups=[view(g) for g in groups],
                                total=view(total))

    @app.get("/v1/usage/savings", response_model=SavingsView, tags=["usage"], responses=_ERR)
    def usage_savings(who: Caller, start: Annotated[datetime, _FROM], end: Annotated[datetime, _TO],
                      team: Annotated[str | None, _TEAM] = None) -> SavingsView:
        """What the jobs whose lines start in ``[from, to)`` cost where they ran, against the same GPU-hours all
        on the cheapest cloud offer of their GPU type now and all on-prem (the pools' amortised USD/GPU-h plus
        the ledger's own energy USD/GPU-h), priced from the ledger and the broker's price catalog and signals.
        Unallocated (idle) lines are no job's and are left out. Team tokens: their own team only."""
        team, start, end = scope(who, team, start, end)
        with store.session() as s:  # the rates are the whole ledger's, whoever asks
            every = usage_repo.usage_rows(s, start=start, end=end, team=None)
            live = [(pool, gpu_type) for _n, pool, gpu_type, _g, _r in usage_repo.registered_nodes(s, end)]
        cloud, onprem, notes = ledger.counterfactual_rates(ledger.prices(), every, start, end, live)
        sv = savings([r for r in every if team is None or r.team == team], cloud, onprem)
        return SavingsView(start=start, end=end, team=team, gpu_hours=exact_float(sv.gpu_hours),
                           actual_usd=sv.actual_usd,
                           cheapest_cloud_usd=sv.cheapest_cloud_usd, onprem_only_usd=sv.onprem_only_usd,
                           saved_vs_cheapest_cloud_usd=sv.saved_vs_cheapest_cloud_usd,
                           saved_vs_onprem_only_usd=sv.saved_vs_onprem_only_usd, units=sv.units,
                           not_compared_units=sv.not_compared_units, not_compared_gpu_hours=exact_float(sv.not_compared_gpu_hours),
                           cloud_usd_per_gpu_hour=cloud, onprem_usd_per_gpu_hour=onprem, reasons=list(sv.reasons),
                           rate_notes=notes)

    @app.get("/v1/usage/focus", tags=["usage"], response_class=Response,
             responses={200: {"description": "a FOCUS 1.2 CSV (broker.focus): every Mandatory column, then the "
                                             "Conditional ones filled and the x_ extensions",
                              "content": {"text/csv": {"schema": {"type": "string"}}},
                              "headers": {SKIPPED_HEADER: {"description": "ledger lines left out: cost unknown",
                                                           "schema": {"type": "integer", "minimum": 0}}}},
                        **_ERR})
    def usage_focus(who: Caller, start: Annotated[datetime, _FROM], end: Annotated[datetime, _TO],
                    team: Annotated[str | None, _TEAM] = None) -> Response:
        """The ledger lines that start in ``[from, to)`` as a FOCUS 1.2 CSV. Lines whose cost is unknown
        (flagged in the ledger) are not FOCUS rows (BilledCost is not nullable); the ``X-Fedbroker-Skipped-Lines``
        header counts them. Team tokens: their own team only (403 for another); admin and finance tokens: every
        team (or ``team``)."""
        team, start, end = scope(who, team, start, end)
        buf = io.StringIO()
        done = write_focus_csv(records(team, start, end), accounts, buf)
        name = f"focus-{start:%Y%m%dT%H%M%SZ}-{end:%Y%m%dT%H%M%SZ}.csv"
        return Response(buf.getvalue(), media_type="text/csv; charset=utf-8",
                        headers={SKIPPED_HEADER: str(len(done.skipped)),
                                 "Content-Disposition": f'attachment; filename="{name}"'})
