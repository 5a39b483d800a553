"""The OpenAPI pages, served without a CDN, and the operationIds of the document.

- operationIds are the handlers' names (`list_requests`, `download_adapter`): stable, unique, snake_case;
  `create_app` passes `operation_id` as FastAPI's `generate_unique_id_function`.
- The bearer scheme (`bearerAuth`) comes from `api.deps.current_key`, so every operation that takes an API key
  lists it and Swagger UI shows its Authorize button.
- `/docs` (Swagger UI) and `/redoc` load their scripts from `/docs/assets`, the files the `fastapi-offline`
  package ships, so both pages work with no network.
- `extend_openapi(app, declare)`: a module that adds to the document (error statuses, params schemas) wraps
  `app.openapi` with it, so the addition is made once, when the document is first built.

    install_docs(app)   # the app is built with docs_url=None, redoc_url=None
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.resources import files
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import HTMLResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles

ASSETS_URL = "/docs/assets"
ASSETS_DIR = files("fastapi_offline") / "static"  # swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js


def operation_id(route: APIRoute) -> str:
    """The handler's name: handlers are named `verb_noun` (tests/test_openapi.py checks they are unique)."""
    return route.name


def extend_openapi(app: FastAPI, declare: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Wrap `app.openapi` so the document built (and cached) is `declare(document)`."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = declare(build())
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def install_docs(app: FastAPI) -> None:
    """`/docs`, `/docs/oauth2-redirect` and `/redoc`, each loading only local assets."""
    app.mount(ASSETS_URL, StaticFiles(directory=str(ASSETS_DIR)), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"
    title = f"{app.title} - API docs"

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=title,
            oauth2_redirect_url="/docs/oauth2-redirect",
            swagger_js_url=f"{ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_URL}/favicon.png",
            swagger_ui_parameters={"persistAuthorization": True},
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        page = get_redoc_html(
            openapi_url=openapi_url,
            title=title,
            redoc_js_url=f"{ASSETS_URL}/redoc.standalone.js",
            redoc_favicon_url=f"{ASSETS_URL}/favicon.png",
            with_google_fonts=False,
        )
        # Redoc's footer always asks its CDN for a logo (hidden when it fails): the browser is not to ask.
        page.headers["Content-Security-Policy"] = "img-src 'self' data:"
        return page
