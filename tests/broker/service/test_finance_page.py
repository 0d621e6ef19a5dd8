"""The finance page (``GET /finance``, issue #12 item 7) in a real headless Chromium (Debian's ``chromium``, driven
by Playwright for Python) against the API served by uvicorn over real PostgreSQL, with the hand-worked ledger of
:mod:`tests.broker.service.test_usage_api` (March 2024: alpha 10.6 USD on AWS and GCP, beta 6.6 USD on-prem).

The budgets are read "now" = 2024-03-11 00:00 UTC (``utcnow`` of the budget routes and the page patched), so the
burn-down is worked by hand too (:mod:`broker.service.budgets`; March has 31 days, 10 elapsed, 21 left):

* alpha, cap 40 USD: spent = its March cloud lines 0.6 + 10.0 = 10.6, committed 0 -> 29.4 left now; forecast
  10.6 + 10.6 / 10 d x 21 d = 32.86 -> 40 - 32.86 = 7.14 left at month end.
* beta, cap 5 USD: no cloud line (on-prem only) -> 5 left now and forecast 0 -> 5 left at month end.

Each test saves a screenshot under ``tests/artifacts/`` (ignored by git) and prints its path. Without Chromium
or Playwright the tests are skipped, except under CI (``CI`` set), where ``.ci/run`` installs both: there they fail.
"""

from __future__ import annotations

import os
import shutil
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from broker.service import api_budgets, api_finance
from broker.service.api import create_app
from broker.service.budgets import set_budget
from broker.service.settings import BrokerSettings
from broker.service.store import usage
from broker.service.tokens import create_token
from tests.broker.harness import ServerThread
from tests.broker.service.test_usage_api import ledger, rates  # noqa: F401 (fixture: the counterfactuals' prices)

UTC = timezone.utc
NOW = datetime(2024, 3, 11, tzinfo=UTC)
ADMIN = "admin-" + uuid.uuid4().hex
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - CI installs it (pyproject dev extras)
    sync_playwright = None

_missing = None if sync_playwright is not None and os.path.exists(CHROMIUM) else (
    "needs Playwright for Python and Debian's chromium (.ci/run installs both)")
if _missing and os.environ.get("CI"):
    raise RuntimeError(_missing)
browser_needed = pytest.mark.skipif(_missing is not None, reason=_missing or "")


@pytest.fixture
def world(pg_store, monkeypatch):
    monkeypatch.setattr(api_budgets, "utcnow", lambda: NOW)
    monkeypatch.setattr(api_finance, "utcnow", lambda: NOW)
    alpha, beta = "alpha" + uuid.uuid4().hex[:6], "beta" + uuid.uuid4().hex[:6]
    with pg_store.session() as s:
        assert usage.add_usage(s, ledger(alpha, beta), datetime(2024, 4, 2, tzinfo=UTC)) == 7
    set_budget(pg_store, alpha, 40.0, now=NOW)
    set_budget(pg_store, beta, 5.0, now=NOW)
    app = create_app(pg_store, BrokerSettings(admin_token=ADMIN))
    return {"app": app, "alpha": alpha, "beta": beta, "admin": ADMIN,
            "alpha_ro": create_token(pg_store, alpha, "read-only", label="finance").token,
            "fin": create_token(pg_store, "finance-office", "finance", label="cfo").token}


@pytest.fixture(scope="module")
def browser():
    if _missing:
        pytest.skip(_missing)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def open_page(browser, url: str, token: str, shot: str):
    """Load ``url`` in a fresh context, paste ``token``, wait for the figures; returns (page, console errors)."""
    ctx = browser.new_context(viewport={"width": 1400, "height": 1600})
    page = ctx.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
    page.on("response", lambda r: errors.append(f"{r.status} {r.url}") if r.status >= 400 else None)
    page.goto(url)
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_selector("#finance[data-loaded]")
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / shot
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return page, errors


def bars(page, chart: str) -> list[tuple[str, float]]:
    return [(k, round(float(v), 9)) for k, v in page.eval_on_selector_all(
        f"#{chart} svg rect.bar", "rs => rs.map(r => [r.dataset.key, r.dataset.value])")]


def points(page) -> dict[tuple[str, str], float]:
    return {(t, k): round(float(v), 9) for t, k, v in page.eval_on_selector_all(
        "#chart-budget svg circle.point", "cs => cs.map(c => [c.dataset.team, c.dataset.point, c.dataset.value])")}


@browser_needed
def test_admin_sees_every_team_in_real_chromium(world, browser, rates):  # noqa: F811
    a, b = world["alpha"], world["beta"]
    with ServerThread(world["app"]) as srv:
        page, errors = open_page(browser, f"{srv.url}/finance?from=2024-03-01&to=2024-04-01", world["admin"],
                                 "finance-admin.png")
        assert page.get_attribute("#finance", "data-loaded") == "true", page.text_content("#status")
        assert errors == []
        assert page.text_content("#scope") == "All teams (admin or finance token)."
        assert bars(page, "chart-team") == [(a, 10.6), (b, 6.6)]
        assert bars(page, "chart-provider") == [("aws", 0.6), ("gcp", 10.0), ("onprem", 6.6)]
        days = ["2024-03-01", "2024-03-02", "2024-03-05"]
        assert bars(page, "chart-day-cost") == list(zip(days, [0.6, 16.6, 0.0]))
        assert bars(page, "chart-day-gpu") == list(zip(days, [0.1, 8.0, 1.0]))
        assert bars(page, "chart-day-kwh") == list(zip(days, [0.1, 5.0, 0.0]))
        assert bars(page, "chart-day-co2") == list(zip(days, [0.04, 1.1, 0.0]))
        assert points(page) == {(a, "start"): 40.0, (a, "now"): 29.4, (a, "forecast"): 7.14,
                                (b, "start"): 5.0, (b, "now"): 5.0, (b, "forecast"): 5.0}
        # totals: line 5's unknown cost, energy and carbon are flagged, not summed as 0
        assert page.eval_on_selector_all("#totals td", "ts => ts.map(t => t.textContent)") == [
            "17.20", "0.00", "9.10", "5.10", "1.14", "5", "1", "3"]
        assert "1 line(s) of unknown cost" in page.text_content("#status")
        assert bars(page, "chart-line") == [("amortised", 6.0), ("energy", 0.6), ("instance", 10.6)]
        # savings (tests/broker/service/test_usage_api.py: 8.1 GPU-h at 1.20 and 1.65 USD/GPU-h; beta's rank 5
        # of unknown cost not compared)
        assert bars(page, "chart-savings") == [("actual", 17.2), ("all on cheapest cloud now", 9.72),
                                               ("on-prem only", 13.365)]
        assert page.eval_on_selector_all("#savings td", "ts => ts.map(t => t.textContent)") == [
            "8.10", "17.20", "9.72", "13.37", "-7.48", "-3.84", "1.00"]  # broker.money: 13.365 half up (cb5ea98: 13.36)
        assert "1 unit(s) left out: a line of unknown cost" in page.text_content("#savings-notes")
        # the token stays out of the URL; it is in this tab's sessionStorage, so a reload shows the figures again
        assert world["admin"] not in page.url
        page.reload()
        page.wait_for_selector("#finance[data-loaded=true]")
        assert len(bars(page, "chart-team")) == 2
        page.click("#forget")
        assert page.evaluate("sessionStorage.length") == 0 and page.is_hidden("#report")


@browser_needed
def test_the_page_formats_figures_as_broker_money_does_with_no_float_noise(world, pg_store, browser, rates):  # noqa: F811
    """The walk-through's page showed ``2.2e-16`` saved and 2 significant digits of mixed precision (0.38, 0.0094):
    the page's formatter gives :func:`broker.money.figure_text`'s text for awkward columns, and no figure on the
    loaded page has an exponent or is a negative zero."""
    from broker.money import decimals_for, figure_text

    with ServerThread(world["app"]) as srv:
        page, errors = open_page(browser, f"{srv.url}/finance?from=2024-03-01&to=2024-04-01", world["fin"],
                                 "finance-figures.png")
        assert errors == []
        cases = [[0.0125, 0.0287, 0.0412], [2.2e-16, -2.2e-16, 0.0], [0.38, 0.0094, 0.016], [-0.0], [13.365, -3.835],
                 [1234567.891, 0.5], [1e-12, 3e-10], [0.1 + 0.2], [-1e-11, 7.0], [None, 1.0]]
        for col in cases:
            js = page.evaluate("c => { const d = window.fedbrokerFigures.decimalsFor(c); "
                               "return [d, c.map(v => window.fedbrokerFigures.figureText(v, d))]; }", col)
            places = decimals_for(col)
            assert js == [places, [figure_text(v, places) if v is not None else "unknown" for v in col]], col
        assert page.evaluate("window.fedbrokerFigures.figureText(2.2e-16, 2)") == "0.00"
        assert page.evaluate("window.fedbrokerFigures.figureText(-0.001, 2)") == "0.00"  # never -0.00
        texts = page.eval_on_selector_all("svg text, #totals td, #savings td", "ts => ts.map(t => t.textContent)")
        assert not [t for t in texts if "e-" in t or t.startswith("-0") and t.strip("-0.,") == ""], texts


@browser_needed
def test_idle_cost_is_its_own_figure_and_bar(world, pg_store, browser):
    """On top of the ledger: alpha's instance left running 1 h after its job (an ``idle`` line, 3.06 USD on
    03-02) and node n1's idle GPUs (an ``idle_amortised`` line, no team, 4 GPU x 1 h x 0.50 = 2.00 USD on 03-05):
    idle 5.06 USD of 22.26."""
    from broker.usage import UsageRecord

    a = world["alpha"]
    t = datetime(2024, 3, 2, 12, tzinfo=UTC)
    extra = [UsageRecord(job_id="job-idle", attempt=1, rank=0, line="idle", resource="i-idle", team=a, start=t,
                         end=t.replace(hour=13), provider="aws", region="us-east-1", gpu_type="V100", gpu_count=1,
                         run_s=3600.0, billed_s=3600.0, list_unit_price_usd=3.06, billed_usd=3.06, energy_kwh=0.046,
                         carbon_kg=0.0184),
             UsageRecord(job_id="", attempt=0, rank=0, line="idle_amortised", resource="n1", team="",
                         start=t.replace(day=5), end=t.replace(day=5, hour=13), provider="onprem", pool="site",
                         gpu_type="V100", gpu_count=4, run_s=3600.0, billed_s=3600.0, pricing_unit="GPU-Hours",
                         list_unit_price_usd=0.5, billed_usd=2.0, energy_kwh=0.0, carbon_kg=0.0)]
    with pg_store.session() as s:
        assert usage.add_usage(s, extra, NOW) == 2
    with ServerThread(world["app"]) as srv:
        page, errors = open_page(browser, f"{srv.url}/finance?from=2024-03-01&to=2024-04-01", world["admin"],
                                 "finance-idle.png")
        assert page.get_attribute("#finance", "data-loaded") == "true", page.text_content("#status")
        assert errors == []
        assert page.eval_on_selector_all("#totals td", "ts => ts.map(t => t.textContent)")[:2] == ["22.26", "5.06"]
        assert bars(page, "chart-line") == [("amortised", 6.0), ("energy", 0.6), ("idle", 3.06),
                                            ("idle_amortised", 2.0), ("instance", 10.6)]
        assert ("(unallocated)", 2.0) in bars(page, "chart-team")
        # a team token sees its own idle line, not the pools'
        page, errors = open_page(browser, f"{srv.url}/finance?from=2024-03-01&to=2024-04-01", world["alpha_ro"],
                                 "finance-idle-team.png")
        assert errors == []
        assert page.eval_on_selector_all("#totals td", "ts => ts.map(t => t.textContent)")[:2] == ["13.66", "3.06"]


@browser_needed
def test_a_team_token_sees_its_own_team_only(world, browser):
    a, b = world["alpha"], world["beta"]
    with ServerThread(world["app"]) as srv:
        page, errors = open_page(browser, f"{srv.url}/finance?from=2024-03-01&to=2024-04-01", world["alpha_ro"],
                                 "finance-team.png")
        assert page.get_attribute("#finance", "data-loaded") == "true", page.text_content("#status")
        assert errors == []
        assert page.text_content("#scope") == f"Team {a} only (your token's team)."
        assert bars(page, "chart-team") == [(a, 10.6)]
        assert bars(page, "chart-provider") == [("aws", 0.6), ("gcp", 10.0)]
        # the GCP line starts on 03-02 23:30 UTC; beta's on-prem lines are not there
        assert bars(page, "chart-day-cost") == [("2024-03-01", 0.6), ("2024-03-02", 10.0)]
        assert bars(page, "chart-day-gpu") == [("2024-03-01", 0.1), ("2024-03-02", 4.0)]
        assert points(page) == {(a, "start"): 40.0, (a, "now"): 29.4, (a, "forecast"): 7.14}
        assert b not in page.content()


@browser_needed
def test_a_finance_token_sees_every_team(world, browser):
    a, b = world["alpha"], world["beta"]
    with ServerThread(world["app"]) as srv:
        page, errors = open_page(browser, f"{srv.url}/finance?from=2024-03-01&to=2024-04-01", world["fin"],
                                 "finance-finance-token.png")
        assert page.get_attribute("#finance", "data-loaded") == "true", page.text_content("#status")
        assert errors == []
        assert page.text_content("#scope") == "All teams (admin or finance token)."
        assert bars(page, "chart-team") == [(a, 10.6), (b, 6.6)]
        assert points(page)[(b, "now")] == 5.0


@browser_needed
def test_a_bad_token_shows_the_error_and_no_figures(world, browser):
    with ServerThread(world["app"]) as srv:
        page, _ = open_page(browser, f"{srv.url}/finance", "not-a-token", "finance-bad-token.png")
        assert page.get_attribute("#finance", "data-loaded") == "error"
        assert "401 unknown or revoked token" in page.text_content("#status")
        assert page.is_hidden("#report")
        assert page.evaluate("sessionStorage.length") == 0  # a refused token is not kept


def test_the_page_headers_period_and_bad_input(world):
    with TestClient(world["app"]) as c:
        r = c.get("/finance")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        # the default period is this month (UTC) at "now" = 2024-03-11
        assert 'data-from="2024-03-01T00:00:00Z" data-to="2024-04-01T00:00:00Z"' in r.text
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
        assert r.headers["referrer-policy"] == "no-referrer" and r.headers["cache-control"] == "no-store"
        r = c.get("/finance", params={"from": "2024-03-05T12:00:00+02:00", "to": "2024-03-06"})
        assert 'data-from="2024-03-05T10:00:00Z" data-to="2024-03-06T00:00:00Z"' in r.text
        r = c.get("/finance", params={"from": "2024-03-05", "to": "2024-03-05"})
        assert r.status_code == 422 and r.json()["detail"][0]["msg"].startswith("to='2024-03-05T00:00:00+00:00'")
        r = c.get("/finance", params={"from": "yesterday"})
        assert r.status_code == 422 and "from" in str(r.json()["detail"])
        for name, kind in (("finance.js", "text/javascript"), ("finance.css", "text/css")):
            r = c.get(f"/finance/{name}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert "/finance" not in c.get("/openapi.json").json()["paths"]  # a page, not an API operation
