"""`blade worker`: a Celery worker process, configured by BLADE_* environment variables. `worker_argv`
turns the flags into `celery worker` arguments (one task per child process on the unlearn queue, the periodic
schedule with the maintenance queue).

    blade worker --queues unlearn                # a GPU worker: one task per child process, acks late"""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

from blade_service.cli.main import CliError

EMBEDDED_QUEUES = "unlearn,inference,maintenance"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("worker", help="a Celery worker process, configured by BLADE_* variables")
    p.add_argument(
        "--queues",
        default=EMBEDDED_QUEUES,
        help="comma-separated: unlearn (GPU training), inference, maintenance (the reconciler)",
    )
    p.add_argument("--concurrency", type=int, default=1, help="tasks at once (one per GPU: keep 1)")
    p.add_argument("--pool", choices=("prefork", "threads", "solo"), default="prefork")
    p.add_argument(
        "--max-tasks-per-child",
        type=int,
        default=None,
        help="default 1 when the worker consumes the unlearn queue with the prefork pool",
    )
    p.add_argument(
        "--beat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the periodic reconciler schedule in this worker (default: when it consumes "
        "the maintenance queue)",
    )
    p.add_argument("--name", default=None, help="Celery node name (default ROLE@hostname)")
    p.add_argument("--loglevel", default=None, help="default BLADE_LOG_LEVEL")
    p.set_defaults(func=run_worker)


def worker_argv(
    *,
    queues: list[str],
    concurrency: int,
    pool: str,
    max_tasks_per_child: int | None,
    beat: bool | None,
    name: str | None,
    loglevel: str,
    schedule_file: Path | None = None,
) -> list[str]:
    """The `celery worker` arguments for one blade worker (pure: tests read them)."""
    from blade_service.contracts.names import Queue

    if max_tasks_per_child is None and pool == "prefork" and Queue.UNLEARN.value in queues:
        max_tasks_per_child = 1  # GPU memory goes back to the driver after every training run
    if beat is None:
        beat = Queue.MAINTENANCE.value in queues
    role = "gpu" if queues == [Queue.UNLEARN.value] else "worker"
    argv = [
        "worker",
        "--queues",
        ",".join(queues),
        "--concurrency",
        str(concurrency),
        "--pool",
        pool,
        "--hostname",
        name or f"{role}@{socket.gethostname()}",
        "--loglevel",
        loglevel.upper(),
        "--without-mingle",
        "--without-gossip",
    ]
    if max_tasks_per_child:
        argv += ["--max-tasks-per-child", str(max_tasks_per_child)]
    if beat:
        argv.append("--beat")
        if schedule_file is not None:
            argv += ["--schedule", str(schedule_file)]
    return argv


def run_worker(args: argparse.Namespace) -> int:
    from blade_service.contracts.names import ALL_QUEUES
    from blade_service.persistence.jsonlog import configure_logging
    from blade_service.persistence.settings import get_settings

    settings = get_settings()
    queues = [q.strip() for q in args.queues.split(",") if q.strip()]
    unknown = [q for q in queues if q not in ALL_QUEUES]
    if unknown or not queues:
        raise CliError(
            f"--queues: unknown queue {unknown[0] if unknown else '(none)'!r}; "
            f"choose from {', '.join(ALL_QUEUES)}"
        )
    configure_logging(service="worker", level=args.loglevel or settings.log_level)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    from blade_service.worker.celery_app import app

    argv = worker_argv(
        queues=queues,
        concurrency=args.concurrency,
        pool=args.pool,
        max_tasks_per_child=args.max_tasks_per_child,
        beat=args.beat,
        name=args.name,
        loglevel=args.loglevel or settings.log_level,
        schedule_file=(settings.data_dir / "celerybeat-schedule").resolve(),
    )
    app.worker_main(argv)
    return 0
