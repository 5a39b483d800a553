"""The ops dashboard (`GET /dashboard`): server-rendered pages, vendored assets, no external requests.

install_dashboard(app)   # in create_app: the pages, their JSON bridge, /dashboard/static, and the security
                         # headers (a strict Content-Security-Policy) on every page and printable certificate
"""

from __future__ import annotations

import re
from pathlib import Path

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from blade_service.api.dashboard import bridge
from blade_service.api.dashboard.views import SignInRequired, router, sign_in_redirect

STATIC_DIR = Path(__file__).resolve().parent / "static"

# Scripts and styles only from our own origin (no inline script, so an injected <script> or on* attribute
# does not run); the pages make requests only to this origin and cannot be framed.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
)
_PAGE_PATHS = re.compile(r"^/dashboard(/|$)|^/unlearn-requests/[^/]+/certificate$")


class SecurityHeaders:
    """Adds SECURITY_HEADERS to every response under /dashboard and to the printable certificate."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _PAGE_PATHS.match(scope.get("path", "")):
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {name for name, _ in message.get("headers", [])}
                extra = [(n, v) for n, v in SECURITY_HEADERS if n not in names]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def install_dashboard(app: FastAPI) -> None:
    app.include_router(bridge.router)
    app.include_router(router)
    app.mount("/dashboard/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")
    app.exception_handler(SignInRequired)(sign_in_redirect)  # the decorator form: typed for a narrow exc
    app.add_middleware(SecurityHeaders)
