"""The finance page (issue #12 item 7), added to :func:`broker.service.api.create_app`::

    GET /finance?from=&to=      text/html: the page (no data in it; the browser fetches the figures, below)
    GET /finance/finance.js     the page's script (served from the package: nothing comes from the internet)
    GET /finance/finance.css    its style sheet

**Where the figures come from (one home).** The page holds no figure: its script reads the JSON API with the
token the user gives it — ``GET /v1/usage/summary`` (by team, provider, ledger line and UTC day over
``[from, to)``, the same SQL sums as ``fedbroker cost report``, :func:`broker.service.store.usage.usage_totals`;
the idle cost is the unallocated lines'), ``GET /v1/usage/savings`` (the counterfactuals,
:func:`broker.usage.savings`) and ``GET /v1/budgets`` (this month's :class:`broker.service.budgets.BudgetState`
per team) — and draws the charts as SVG in the page (no charting library). So a team token sees its own team
only and an admin or finance token every team, exactly as those routes decide, and a read-only token is
enough.

**How the browser authenticates.** A page opened by navigation cannot send ``Authorization: Bearer``, and a
token in a URL leaks into history, logs and ``Referer``. The user pastes the token into a password field; the
script keeps it in ``sessionStorage`` (this tab only, gone when the tab closes) and sends it as the bearer
header of its ``fetch`` calls; "Forget token" removes it. No cookie is set, so no other site can make the
browser send the token (no CSRF), and the page's ``Content-Security-Policy`` allows only this origin's
script and style (no inline script), so injected markup cannot run; figures and names are written as text
(``textContent``), never parsed as HTML. The page itself needs no token and answers the same for everyone.

**The period.** ``from``/``to`` as in ``/v1/usage/summary`` (UTC; a date is its midnight; ``[from, to)``);
both default to this calendar month (UTC). Bad input: 422 naming the field.
"""

from __future__ import annotations

import html
from datetime import datetime
from importlib import resources
from typing import Annotated

from fastapi import FastAPI, Query, Response
from fastapi.responses import HTMLResponse

from broker.service.api_usage import scope_period
from broker.service.budgets import month_bounds
from broker.service.store.tables import utcnow
from broker.utc import iso_z_exact

__all__ = ["register", "PAGE_HEADERS"]

#: the page's response headers: only this origin's script, style and fetches; no framing; no Referer; no cache
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}

_ASSETS = {"finance.js": "text/javascript; charset=utf-8", "finance.css": "text/css; charset=utf-8"}


def _asset(name: str) -> str:
    return resources.files("broker.service").joinpath("static", name).read_text(encoding="utf-8")


def register(app: FastAPI) -> None:
    """Add ``/finance`` and its two assets to ``app`` (not in the OpenAPI schema: a page, not an API operation)."""
    page = _asset("finance.html")
    assets = {name: _asset(name) for name in _ASSETS}

    @app.get("/finance", include_in_schema=False, response_class=HTMLResponse)
    def finance_page(start: Annotated[datetime | None, Query(alias="from")] = None,
                     end: Annotated[datetime | None, Query(alias="to")] = None) -> HTMLResponse:
        """The finance page for ``[from, to)`` (default: this month, UTC)."""
        month = month_bounds(utcnow())
        start, end = scope_period(start or month[0], end or month[1])
        body = page.replace("{{from}}", html.escape(iso_z_exact(start))).replace("{{to}}", html.escape(iso_z_exact(end)))
        return HTMLResponse(body, headers=PAGE_HEADERS)

    def serve(name: str):
        def asset() -> Response:
            return Response(assets[name], media_type=_ASSETS[name], headers=PAGE_HEADERS)
        asset.__name__ = "finance_" + name.replace(".", "_")
        return asset

    for name in _ASSETS:
        app.get(f"/finance/{name}", include_in_schema=False, response_class=Response)(serve(name))
