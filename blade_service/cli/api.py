"""`blade api`: the API process (uvicorn running `blade_service.api.main:server_app`), configured by BLADE_*
environment variables; the API's own middleware writes the access log as JSON lines.

    blade api --workers 4"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("api", help="the API process (uvicorn), configured by BLADE_* variables")
    p.add_argument("--host", default=None, help="default BLADE_HOST")
    p.add_argument("--port", type=int, default=None, help="default BLADE_PORT")
    p.add_argument(
        "--workers", type=int, default=None, help="uvicorn worker processes (default BLADE_API_WORKERS)"
    )
    p.set_defaults(func=run_api)


def run_api(args: argparse.Namespace) -> int:
    import uvicorn

    from blade_service.persistence.jsonlog import configure_logging
    from blade_service.persistence.settings import get_settings

    settings = get_settings()
    configure_logging(service="api", level=settings.log_level)
    uvicorn.run(
        "blade_service.api.main:server_app",
        factory=True,
        host=args.host or settings.host,
        port=args.port or settings.port,
        workers=args.workers or settings.resolved_api_workers(),
        log_level=settings.log_level.lower(),
        log_config=None,
        access_log=False,  # the API's own middleware logs each request as one JSON line ("http.request")
        proxy_headers=True,
    )
    return 0
