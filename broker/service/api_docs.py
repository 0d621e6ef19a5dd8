"""The API docs page, served from the package (issue #20 item 4), added to :func:`broker.service.api.create_app`::

    GET /docs                        text/html: Swagger UI on ``/openapi.json`` (no data in it; no token needed)
    GET /docs/swagger-ui-bundle.js   Swagger UI's script   } from the ``swagger-ui-py`` wheel's copy of the
    GET /docs/swagger-ui.css         Swagger UI's styles   } swagger-ui dist (5.24.2 in swagger-ui-py 25.7.1)
    GET /docs/docs.js                the page's start-up script (``static/docs.js``)

FastAPI's own ``/docs`` (and ``/redoc``) load their scripts from ``cdn.jsdelivr.net``: a blank page on an
air-gapped host, and a third-party script running on the broker's origin, where users paste tokens into
"Authorize". Here every byte comes from the installed packages, and :data:`DOCS_HEADERS`'s
``Content-Security-Policy`` lets the page run only this origin's scripts (no inline script, no ``eval``), fetch
only from this origin (the OpenAPI document and "Try it out"), and load no image but this origin's and
``data:`` ones; it cannot be framed, sends no ``Referer`` and is not cached. Swagger UI sets element styles from
its script (React), which the policy allows; inline ``<style>`` and ``style=`` markup would need
``'unsafe-inline'``, which the policy does not grant (the page renders without).
"""

from __future__ import annotations

import html
import logging
from importlib import resources

from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse

__all__ = ["register", "DOCS_HEADERS", "SWAGGER_ASSETS", "MISSING_PAGE"]

log = logging.getLogger("fedbroker.api")

#: ``/docs`` when ``swagger-ui-py`` is not installed: says so and where the OpenAPI document is (no script)
MISSING_PAGE = ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>fedbroker API</title></head><body>"
                "<p>The API docs need the <code>swagger-ui-py</code> package (a dependency of fedbroker: "
                "<code>pip install swagger-ui-py</code>). The OpenAPI document is at "
                "<a href=\"{{openapi}}\">{{openapi}}</a>.</p></body></html>")

#: the docs page's and its assets' response headers
DOCS_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; font-src 'self' data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}

#: Swagger UI's files served, from the ``swagger_ui`` package's ``static`` directory: name -> media type
SWAGGER_ASSETS = {"swagger-ui-bundle.js": "text/javascript; charset=utf-8", "swagger-ui.css": "text/css; charset=utf-8"}


def _swagger_dist():
    """The ``swagger_ui`` package's ``static`` directory (Swagger UI's dist). Raises ``ModuleNotFoundError``."""
    return resources.files("swagger_ui").joinpath("static")


def register(app: FastAPI) -> None:
    """Add ``/docs`` and its assets to ``app`` (not in the OpenAPI schema); create ``app`` with ``docs_url=None``
    and ``redoc_url=None`` so FastAPI's CDN pages are not there. When the ``swagger-ui-py`` distribution (a dependency in pyproject.toml) is missing: then ``/docs`` is
    :data:`MISSING_PAGE` (a warning in the log; the API itself is unaffected)."""
    own = resources.files("broker.service").joinpath("static")
    try:
        dist = _swagger_dist()
        page = own.joinpath("docs.html").read_text(encoding="utf-8")
        assets = {name: (dist.joinpath(name).read_bytes(), media) for name, media in SWAGGER_ASSETS.items()}
        assets["docs.js"] = (own.joinpath("docs.js").read_bytes(), "text/javascript; charset=utf-8")
    except (ModuleNotFoundError, FileNotFoundError) as e:
        log.warning("/docs: Swagger UI is not installed (%s): pip install swagger-ui-py; serving a page that "
                    "links /openapi.json", e)
        page, assets = MISSING_PAGE, {}

    @app.get("/docs", include_in_schema=False, response_class=HTMLResponse)
    def docs_page(request: Request) -> HTMLResponse:
        """Swagger UI on this broker's OpenAPI document (behind a proxy: under the app's ``root_path``)."""
        root = request.scope.get("root_path", "").rstrip("/")
        body = (page.replace("{{root}}", html.escape(root))
                .replace("{{openapi}}", html.escape(root + (app.openapi_url or "/openapi.json"))))
        return HTMLResponse(body, headers=DOCS_HEADERS)

    def serve(name: str):
        data, media = assets[name]

        def asset() -> Response:
            return Response(data, media_type=media, headers=DOCS_HEADERS)
        asset.__name__ = "docs_" + name.replace(".", "_").replace("-", "_")
        return asset

    for name in assets:
        app.get(f"/docs/{name}", include_in_schema=False, response_class=Response)(serve(name))
