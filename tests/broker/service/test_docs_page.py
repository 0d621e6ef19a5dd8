"""``GET /docs`` (issue #20 item 4): Swagger UI served from the package under a strict Content-Security-Policy,
nothing from a CDN (cb5ea98 loaded swagger-ui from cdn.jsdelivr.net: blank when air-gapped, and a third-party
script on the page where users paste tokens). In TestClient, and in a real headless Chromium (Debian's
``chromium`` through Playwright, as :mod:`tests.broker.service.test_finance_page`) that records every request."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from broker.service.api import create_app
from broker.service.api_docs import DOCS_HEADERS
from broker.service.settings import BrokerSettings
from tests.broker.harness import ServerThread
from tests.broker.service.test_finance_page import CHROMIUM, browser, browser_needed  # noqa: F401 (fixture)

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
       "font-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


@pytest.fixture
def app(pg_store):
    return create_app(pg_store, BrokerSettings(admin_token="admin-docs"))


def test_docs_reference_no_external_host_and_carry_a_strict_csp(app):
    with TestClient(app) as c:
        r = c.get("/docs")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert r.headers["content-security-policy"] == CSP == DOCS_HEADERS["Content-Security-Policy"]
        assert (r.headers["referrer-policy"], r.headers["x-content-type-options"]) == ("no-referrer", "nosniff")
        assert not re.search(r"(?i)https?:|//[a-z]", r.text), r.text  # cb5ea98: https://cdn.jsdelivr.net/...
        assert "<script>" not in r.text and " style=" not in r.text  # no inline script or style for the CSP to allow
        refs = re.findall(r'(?:src|href)="([^"]*)"', r.text)
        assert refs == ["data:,", "/docs/swagger-ui.css", "/docs/swagger-ui-bundle.js", "/docs/docs.js"]
        assert 'data-openapi="/openapi.json"' in r.text
        js = c.get("/docs/swagger-ui-bundle.js")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        assert len(js.content) > 1_000_000 and b"SwaggerUIBundle" in js.content[:2000]
        css = c.get("/docs/swagger-ui.css")
        assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
        assert c.get("/docs/docs.js").headers["content-security-policy"] == CSP
        assert c.get("/redoc").status_code == 404  # FastAPI's ReDoc page loads from the CDN too: not served
        assert c.get("/docs/oauth2-redirect").status_code == 404


def test_without_swagger_ui_installed_docs_say_so_and_the_api_still_starts(pg_store, monkeypatch, caplog):
    from broker.service import api_docs

    def missing():
        raise ModuleNotFoundError("No module named 'swagger_ui'")

    monkeypatch.setattr(api_docs, "_swagger_dist", missing)
    with TestClient(create_app(pg_store, BrokerSettings(admin_token="admin-docs"))) as c:
        r = c.get("/docs")
        assert r.status_code == 200 and r.headers["content-security-policy"] == CSP
        assert "need the <code>swagger-ui-py</code> package" in r.text and 'href="/openapi.json"' in r.text
        assert c.get("/docs/swagger-ui-bundle.js").status_code == 404
        assert c.get("/healthz").status_code == 200
    assert "/docs: Swagger UI is not installed" in caplog.text


@browser_needed
def test_docs_render_every_operation_in_chromium_with_no_request_off_the_origin(app, browser):  # noqa: F811
    with ServerThread(app) as srv:
        ctx = browser.new_context(viewport={"width": 1400, "height": 1600})
        page = ctx.new_page()
        requests: list[str] = []
        errors: list[str] = []
        page.on("request", lambda r: requests.append(r.url))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{srv.url}/docs")
        page.wait_for_selector(".opblock")
        with TestClient(app) as c:
            doc = c.get("/openapi.json").json()
        operations = sum(len([m for m in ops if m in ("get", "put", "post", "delete", "patch")])
                         for ops in doc["paths"].values())
        assert page.locator(".opblock").count() == operations
        assert page.text_content(".info .title").startswith("fedbroker")
        off_origin = [u for u in requests if not (u.startswith(srv.url + "/") or u.startswith("data:"))]
        assert off_origin == []
        assert sorted({u[len(srv.url):] for u in requests if u.startswith(srv.url)}) == [
            "/docs", "/docs/docs.js", "/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css", "/openapi.json"]
        assert errors == []  # a CSP violation is a console error
        ctx.close()
