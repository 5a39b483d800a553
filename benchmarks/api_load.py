"""API load benchmark: throughput and p50/p99 latency of `GET /unlearn-requests/{id}` and
`POST /unlearn-requests` against PostgreSQL, beside a plain FastAPI + SQLAlchemy + PostgreSQL peer doing the
same work (an API-key lookup and one primary-key select) and a bare uvicorn hello-world, on the same machine
in the same run.

The figure that matters is ours / the plain peer: what the service costs beyond the least a FastAPI app must
do to answer the same poll. The hello-world shows the machine's HTTP ceiling (one uvicorn process, the same
load generator). Each target is measured alone (one connection: latency) and under load (`--concurrency`).

    python -m benchmarks.api_load                                  # 32 connections, 15 s / 4000 requests each
    python -m benchmarks.api_load --duration 5 --requests 1500 --json out/api_load.json   # a brief run

What it does, all on 127.0.0.1 and bounded in count and time:
1. creates a fresh PostgreSQL database (dropped at the end) and a dedicated Redis db number for the broker;
2. starts the API (`blade api`, one uvicorn process, no access log), the plain peer (`peer_app`, one uvicorn
   process on the same database) and a bare uvicorn hello-world app;
3. bootstraps an admin key, registers a base model, uploads two datasets, submits one request;
4. drives each target with a small keep-alive HTTP/1.1 client (asyncio, one process) for `--duration` seconds
   or `--requests` requests, whichever comes first, after a warm-up; prints a table, the ratios and the
   load average (the box may be shared: read the ratios, not the absolute figures). Besides latency it reads
   CPU time from /proc: the server process's, and that of the database backends serving the benchmark's
   database (where PostgreSQL runs on this machine; its WAL writer and checkpointer are not counted);
5. calls the submission and the status read `--in-process` times each in this process, through the
   service's own session factories (`in_process_costs`): the persistence layer's CPU and latency without
   HTTP, a steadier figure for comparing two versions of it on a noisy box.
Nothing consumes the queued requests (no worker): the POST figures are the API's own cost. POST is measured
twice: behind other requests of the same base model (the common case under load: only the head of a base
model's queue may run, so nothing is published; the worker publishes it when the one before it finishes),
and as the head of its queue, one fresh base model per request, which also publishes the task (once the 202
is sent: that counts in the server's CPU per request, and in the latency only through contention).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


# --- the hello-world target: a bare ASGI app (what uvicorn alone can do) ------------------------------------


async def hello_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b'{"hello":"world"}'
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


# --- the plain peer: FastAPI + SQLAlchemy + PostgreSQL doing the same work, written the textbook way -------

PEER_DB_ENV = "BLADE_BENCH_PEER_DATABASE_URL"


def peer_app() -> Any:
    """`GET /unlearn-requests/{id}`: look the bearer key up by its sha256, select the request by primary key,
    return a few of its columns. A session per HTTP request, sync handlers, a 10-connection pool."""
    import hashlib

    from fastapi import Depends, FastAPI, Header, HTTPException
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session, sessionmaker

    engine = create_engine(os.environ[PEER_DB_ENV], pool_size=10, max_overflow=20)
    make_session = sessionmaker(engine)
    app = FastAPI()

    def session() -> Any:
        with make_session() as s:
            yield s

    def api_key(s: Session = Depends(session), authorization: str = Header("")) -> str:
        digest = hashlib.sha256(authorization.removeprefix("Bearer ").encode()).hexdigest()
        row = s.execute(
            text("SELECT id, tenant_id FROM api_keys WHERE key_hash = :h AND revoked_at IS NULL"),
            {"h": digest},
        ).first()
        if row is None:
            raise HTTPException(401)
        return row.tenant_id

    @app.get("/unlearn-requests/{request_id}")
    def get_request(request_id: str, tenant: str = Depends(api_key), s: Session = Depends(session)) -> Any:
        row = s.execute(
            text(
                "SELECT id, status, step, total_steps, method, queue_seq, created_at, updated_at "
                "FROM unlearn_requests WHERE id = :id AND tenant_id = :t"
            ),
            {"id": request_id, "t": tenant},
        ).first()
        if row is None:
            raise HTTPException(404)
        return dict(row._mapping)

    return app


# --- a small keep-alive HTTP/1.1 load generator -------------------------------------------------------------


@dataclass
class Result:
    name: str
    requests: int
    errors: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    statuses: dict[str, int]
    cpu_ms_per_request: float | None = None  # the server process's CPU time (all threads) per request
    db_cpu_ms_per_request: float | None = None  # the CPU time of the database's backends per request


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    length, chunked = 0, False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value.strip())
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if chunked:
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    elif length:
        await reader.readexactly(length)
    return status


async def _conn_loop(
    host: str,
    port: int,
    make_request: Any,
    deadline: float,
    budget: list[int],
    latencies: list[float],
    statuses: dict[str, int],
    errors: list[int],
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < deadline and budget[0] > 0:
            budget[0] -= 1
            payload = make_request()
            started = time.perf_counter()
            writer.write(payload)
            try:
                status = await _read_response(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                errors[0] += 1
                writer.close()
                reader, writer = await asyncio.open_connection(host, port)
                continue
            latencies.append(time.perf_counter() - started)
            statuses[str(status)] = statuses.get(str(status), 0) + 1
            if status >= 400:
                errors[0] += 1
    finally:
        writer.close()


async def _drive(
    name: str,
    host: str,
    port: int,
    make_request: Any,
    *,
    concurrency: int,
    duration: float,
    max_requests: int,
) -> Result:
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    errors = [0]
    budget = [max_requests]
    started = time.perf_counter()
    deadline = started + duration
    await asyncio.gather(
        *(
            _conn_loop(host, port, make_request, deadline, budget, latencies, statuses, errors)
            for _ in range(concurrency)
        )
    )
    seconds = time.perf_counter() - started
    latencies.sort()
    n = len(latencies)

    def pct(p: float) -> float:
        return latencies[min(n - 1, int(p * n))] * 1000 if n else float("nan")

    return Result(
        name=name,
        requests=n,
        errors=errors[0],
        seconds=round(seconds, 3),
        rps=round(n / seconds, 1),
        p50_ms=round(pct(0.50), 2),
        p99_ms=round(pct(0.99), 2),
        mean_ms=round(statistics.fmean(latencies) * 1000, 2) if n else float("nan"),
        statuses=statuses,
    )


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of process `pid` so far (Linux /proc), None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError, TypeError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def backends_cpu_seconds(admin_url: str, db_name: str) -> dict[int, float]:
    """CPU time so far of each PostgreSQL backend connected to `db_name`, by pid: empty when the server is
    not on this machine (its processes are not in /proc)."""
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", [db_name])
        pids = [pid for (pid,) in rows]
    return {pid: cpu for pid in pids if (cpu := cpu_seconds(pid)) is not None}


def run_load(
    name: str,
    host: str,
    port: int,
    make_request: Any,
    *,
    concurrency: int,
    duration: float,
    max_requests: int,
    warmup: int,
    server_pid: int | None = None,
    database_cpu: Callable[[], dict[int, float]] | None = None,
) -> Result:
    asyncio.run(
        _drive(
            f"{name} (warm-up)",
            host,
            port,
            make_request,
            concurrency=min(concurrency, 8),
            duration=5.0,
            max_requests=warmup,
        )
    )
    cpu_before = cpu_seconds(server_pid)
    db_before = database_cpu() if database_cpu else {}
    result = asyncio.run(
        _drive(
            name,
            host,
            port,
            make_request,
            concurrency=concurrency,
            duration=duration,
            max_requests=max_requests,
        )
    )
    cpu_after = cpu_seconds(server_pid)
    db_after = database_cpu() if database_cpu else {}
    if cpu_before is not None and cpu_after is not None and result.requests:
        result.cpu_ms_per_request = round((cpu_after - cpu_before) * 1000 / result.requests, 2)
    if db_after and result.requests:  # a backend opened during the run counts from zero
        db_seconds = sum(cpu - db_before.get(pid, 0.0) for pid, cpu in db_after.items())
        result.db_cpu_ms_per_request = round(db_seconds * 1000 / result.requests, 2)
    return result


@dataclass
class InProcess:
    """The service's own work for one request, called in this process (no HTTP, no uvicorn): what the
    persistence layer costs, measured apart from the box's HTTP noise."""

    name: str
    calls: int
    p50_ms: float
    cpu_ms: float  # this thread's CPU time per call (psycopg's included; not the database's)


def in_process_costs(db_url: str, data_dir: Path, info: dict[str, str], count: int) -> dict[str, InProcess]:
    """`submit_request` + commit (a request behind others of the bench's base model) and the status read
    (`get_request_view`, the GET's one statement), `count` calls each after a warm-up, through the
    service's own session factories on the benchmark's database."""
    from blade_service.persistence import db, requests
    from blade_service.persistence.models import UnlearnRequest
    from blade_service.persistence.settings import Settings

    settings = Settings(database_url=db_url, data_dir=data_dir)
    write, read = db.session_factory(settings), db.read_session_factory(settings)
    submit = json.loads(info["submit"])
    with read() as session:
        tenant_id = session.get_one(UnlearnRequest, info["request_id"]).tenant_id

    def post() -> None:
        with write() as session:
            requests.submit_request(
                session,
                tenant_id=tenant_id,
                base_model=submit["base_model"],
                forget_dataset=submit["forget_dataset"],
                retain_dataset=submit["retain_dataset"],
                params=submit["params"],
                idempotency_key=uuid.uuid4().hex,
                actor="bench",
            )
            session.commit()

    def get() -> None:
        with read() as session:
            requests.get_request_view(session, tenant_id=tenant_id, request_id=info["request_id"])

    costs = {}
    try:
        for name, call in (("submit_request + commit", post), ("get_request_view", get)):
            for _ in range(min(count, 200)):
                call()
            walls, cpu = [], 0.0
            for _ in range(count):
                started, cpu_started = time.perf_counter(), time.thread_time()
                call()
                cpu += time.thread_time() - cpu_started
                walls.append(time.perf_counter() - started)
            costs[name] = InProcess(
                name, count, round(statistics.median(walls) * 1000, 3), round(cpu * 1000 / count, 3)
            )
    finally:
        db.dispose_engines()
    return costs


def http_request(
    method: str, path: str, host: str, headers: dict[str, str] | None = None, body: bytes = b""
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: keep-alive"]
    for key, value in (headers or {}).items():
        lines.append(f"{key}: {value}")
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


# --- services -----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with status {proc.returncode}")
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not come up within {timeout:g} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def create_database(admin_url: str) -> tuple[str, str]:
    """A fresh database on the server of `admin_url`; (its SQLAlchemy URL, its name)."""
    import psycopg

    name = f"blade_bench_{secrets.token_hex(4)}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = admin_url.rsplit("/", 1)[0]
    return f"{base.replace('postgresql://', 'postgresql+psycopg://', 1)}/{name}", name


def durable_commit_ms(db_url: str, count: int = 200) -> float:
    """p50 latency of the cheapest durable write on `db_url`: a one-row INSERT committed on its own (one round
    trip that waits for the WAL flush). A POST must commit once, a status GET never does, so POST/GET can
    be no lower than (GET p50 + this) / GET p50 on this machine."""
    import psycopg

    times = []
    with psycopg.connect(
        db_url.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True
    ) as conn:
        conn.execute("CREATE TABLE commit_probe (id bigserial PRIMARY KEY, at timestamptz DEFAULT now())")
        for _ in range(count):
            started = time.perf_counter()
            conn.execute("INSERT INTO commit_probe DEFAULT VALUES")
            times.append((time.perf_counter() - started) * 1000)
        conn.execute("DROP TABLE commit_probe")
    return statistics.median(times)


def round_trips_ms(db_url: str, count: int = 2000) -> tuple[float, float]:
    """p50 ms of a submission's transaction shape over trivial SQL, two ways: four round trips (psycopg sends
    BEGIN on its own, then two statements, the second needing the first's row, then COMMIT), and the same in
    psycopg's pipeline mode as two syncs (BEGIN rides with the first statement, the second with the COMMIT).
    The most that pipelining the POST could save on this database (docs/performance.md)."""
    import psycopg

    def sequential(conn: psycopg.Connection[Any]) -> None:
        conn.execute("SELECT %s::int", (1,)).fetchone()
        conn.execute("SELECT %s::int", (2,)).fetchone()
        conn.commit()

    def pipelined(conn: psycopg.Connection[Any]) -> None:
        with conn.pipeline() as pipeline:
            conn.execute("BEGIN")
            first = conn.execute("SELECT %s::int", (1,))
            pipeline.sync()
            first.fetchone()
            conn.execute("SELECT %s::int", (2,))
            conn.execute("COMMIT")

    url = db_url.replace("postgresql+psycopg://", "postgresql://", 1)
    timings: dict[bool, list[float]] = {False: [], True: []}
    with psycopg.connect(url) as plain, psycopg.connect(url, autocommit=True) as piped:
        for i in range(count):  # alternated, so the box's load weighs on both alike
            piping = i % 2 == 1
            started = time.perf_counter()
            if piping:
                pipelined(piped)
            else:
                sequential(plain)
            timings[piping].append((time.perf_counter() - started) * 1000)
    return statistics.median(timings[False]), statistics.median(timings[True])


def drop_database(admin_url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def redis_reachable(url: str) -> bool:
    try:
        import redis

        redis.Redis.from_url(url, socket_connect_timeout=1).ping()
        return True
    except Exception:
        return False


def flush_redis(url: str) -> None:
    import redis

    redis.Redis.from_url(url, socket_connect_timeout=1).flushdb()


def add_base_models(db_url: str, count: int) -> list[str]:
    """`count` shared base models written straight into the database, one per head-of-queue POST (a request
    is published only when nothing is queued before it on its base model). The API's registration checks the
    source; that is not what is measured."""
    import psycopg

    names = [f"bench-head-{i}" for i in range(count)]
    with psycopg.connect(db_url.replace("postgresql+psycopg://", "postgresql://", 1)) as conn:
        conn.cursor().executemany(
            "INSERT INTO base_models (id, name, source, created_at) VALUES (%s, %s, 'bench/none', now())",
            [(f"bm_{name}", name) for name in names],
        )
    return names


def setup_api(base: str, key: str) -> dict[str, str]:
    """Base model, two datasets and one request to read back."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"}
    rows = [
        {"question": f"Where was person {i} born?", "answer": f"Person {i} was born in town {i}."}
        for i in range(20)
    ]
    body = "\n".join(json.dumps(r) for r in rows).encode()
    with httpx.Client(base_url=base, headers=headers, timeout=30) as http:
        http.post(
            "/base-models", json={"name": "bench-model", "source": "bench/none", "shared": True}
        ).raise_for_status()
        forget = http.post("/datasets", files={"file": ("forget.jsonl", body)})
        forget.raise_for_status()
        retain = http.post("/datasets", files={"file": ("retain.jsonl", body)})
        retain.raise_for_status()
        submit = {
            "base_model": "bench-model",
            "forget_dataset": forget.json()["id"],
            "retain_dataset": retain.json()["id"],
            "params": {"max_steps": 5},
        }
        created = http.post("/unlearn-requests", json=submit, headers={"Idempotency-Key": uuid.uuid4().hex})
        created.raise_for_status()
        return {"request_id": created.json()["id"], "submit": json.dumps(submit)}


def start_server(target: list[str], port: int, env: dict[str, str]) -> subprocess.Popen:
    """One uvicorn process serving `target` (an app path, or `--factory path`) on 127.0.0.1:`port`."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            *target,
            *("--host", "127.0.0.1", "--port", str(port), "--no-access-log", "--log-level", "warning"),
        ],
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def write_json_report(args: argparse.Namespace, load_before: str, load_after: str, **fields: Any) -> None:
    """With `--json PATH`: the run's config, the load average before and after, and `fields`, as one file."""
    if not args.json:
        return
    args.json.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "config": vars(args) | {"json": str(args.json)},
        "loadavg": {"before": load_before, "after": load_after},
        **fields,
    }
    args.json.write_text(json.dumps(document, indent=2, default=str))


def _or_dash(value: float | None) -> str:
    return "-" if value is None else str(value)


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=32, help="open keep-alive connections (load)")
    parser.add_argument("--duration", type=float, default=15.0, help="seconds per measurement (cap)")
    parser.add_argument("--requests", type=int, default=4000, help="requests per measurement (cap)")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument(
        "--pg-admin-url",
        default="postgresql://postgres@127.0.0.1:5432/postgres",
        help="a PostgreSQL server where a throw-away database may be created",
    )
    parser.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/13",
        help="broker for the API's publishes (a dedicated db number; flushed)",
    )
    parser.add_argument(
        "--in-process",
        type=int,
        default=1000,
        metavar="N",
        help="also call the submission and the status read N times each in this process (0: skip)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.duration > 120 or args.requests > 100_000:
        parser.error("keep a measurement under 120 s and 100000 requests")

    host = "127.0.0.1"
    key = "bench_" + secrets.token_urlsafe(18)
    db_url, db_name = create_database(args.pg_admin_url)
    data_dir = Path(tempfile.mkdtemp(prefix="blade-bench-"))
    use_redis = redis_reachable(args.redis_url)
    if use_redis:
        flush_redis(args.redis_url)
    env = dict(os.environ)
    env.update(
        {
            "BLADE_DATABASE_URL": db_url,
            "BLADE_DATA_DIR": str(data_dir),
            "BLADE_BOOTSTRAP_ADMIN_KEY": key,
            "BLADE_LOG_LEVEL": "WARNING",
            "BLADE_API_WORKERS": "1",
            PEER_DB_ENV: db_url,
            "PYTHONUNBUFFERED": "1",
        }
    )
    if use_redis:
        env["BLADE_BROKER_URL"] = env["BLADE_RESULT_BACKEND"] = args.redis_url
    api_port, peer_port, hello_port = free_port(), free_port(), free_port()
    procs: list[subprocess.Popen] = []
    results: dict[str, dict[str, Result]] = {}
    load_before = loadavg()
    try:
        hello = start_server(["benchmarks.api_load:hello_app"], hello_port, env)
        procs.append(hello)
        api = subprocess.Popen(
            [sys.executable, "-m", "blade_service.cli", "api", "--host", host, "--port", str(api_port)],
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
        procs.append(api)
        wait_http(f"http://{host}:{hello_port}/", hello)
        wait_http(f"http://{host}:{api_port}/healthz", api)  # migrated the database: the peer may start
        peer = start_server(["--factory", "benchmarks.api_load:peer_app"], peer_port, env)
        procs.append(peer)
        wait_http(f"http://{host}:{peer_port}/docs", peer)
        info = setup_api(f"http://{host}:{api_port}", key)
        auth = {"Authorization": f"Bearer {key}"}
        get_path = f"/unlearn-requests/{info['request_id']}"
        hello_req = http_request("GET", "/", host)
        get_req = http_request("GET", get_path, host, auth)
        body = info["submit"].encode()

        submit = json.loads(info["submit"])
        heads = iter(add_base_models(db_url, 2 * (args.requests + args.warmup)))

        def post_req(body: bytes = body) -> bytes:
            return http_request(
                "POST",
                "/unlearn-requests",
                host,
                {**auth, "Content-Type": "application/json", "Idempotency-Key": uuid.uuid4().hex},
                body,
            )

        def post_head_req() -> bytes:
            return post_req(json.dumps(submit | {"base_model": next(heads)}).encode())

        targets = [
            ("hello-world GET /", hello_port, lambda: hello_req, hello.pid),
            ("plain peer GET (key + pk select)", peer_port, lambda: get_req, peer.pid),
            ("ours GET /unlearn-requests/{id}", api_port, lambda: get_req, api.pid),
            ("ours POST, behind others", api_port, post_req, api.pid),
            ("ours POST, queue head (publish)", api_port, post_head_req, api.pid),
        ]
        for mode, concurrency in (("alone", 1), ("load", args.concurrency)):
            for name, port, make, pid in targets:
                results.setdefault(name, {})[mode] = run_load(
                    name,
                    host,
                    port,
                    make,
                    concurrency=concurrency,
                    duration=args.duration,
                    max_requests=args.requests if concurrency > 1 else max(1, args.requests // 4),
                    warmup=args.warmup,
                    server_pid=pid,
                    database_cpu=lambda: backends_cpu_seconds(args.pg_admin_url, db_name),
                )
        commit_ms = durable_commit_ms(db_url)
        four_trips_ms, pipelined_ms = round_trips_ms(db_url)
        in_process = in_process_costs(db_url, data_dir, info, args.in_process) if args.in_process else {}
    finally:
        for proc in reversed(procs):
            stop(proc)
        drop_database(args.pg_admin_url, db_name)
        if use_redis:
            flush_redis(args.redis_url)

    load_after = loadavg()
    print(
        f"\nAPI load: alone = 1 connection, load = {args.concurrency} connections; <= {args.duration:g} s or "
        f"{args.requests} requests each; one uvicorn process per server; broker "
        f"{'redis' if use_redis else 'sqlite'}; {os.cpu_count()} CPUs; load average before {load_before}, "
        f"after {load_after}\n"
    )
    print(
        f"{'target':34} {'mode':>5} {'requests':>8} {'errors':>6} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'CPU ms/req':>10} {'DB CPU ms/req':>13}"
    )
    for name, modes in results.items():
        for mode, r in modes.items():
            print(
                f"{name:34} {mode:>5} {r.requests:8d} {r.errors:6d} {r.rps:8.1f} {r.p50_ms:8.2f} "
                f"{r.p99_ms:8.2f} {_or_dash(r.cpu_ms_per_request):>10} "
                f"{_or_dash(r.db_cpu_ms_per_request):>13}"
            )
    ours, peer = results["ours GET /unlearn-requests/{id}"], results["plain peer GET (key + pk select)"]
    post, head = results["ours POST, behind others"], results["ours POST, queue head (publish)"]
    ratios = {
        "get_vs_peer_alone_p50": ratio(ours["alone"].p50_ms, peer["alone"].p50_ms),
        "get_vs_peer_load_rps": ratio(ours["load"].rps, peer["load"].rps),
        "get_vs_peer_load_p99": ratio(ours["load"].p99_ms, peer["load"].p99_ms),
        "post_vs_get_alone_p50": ratio(post["alone"].p50_ms, ours["alone"].p50_ms),
        "post_vs_get_load_rps": ratio(post["load"].rps, ours["load"].rps),
        "head_post_vs_get_alone_p50": ratio(head["alone"].p50_ms, ours["alone"].p50_ms),
        "head_post_vs_get_load_rps": ratio(head["load"].rps, ours["load"].rps),
        "get_vs_peer_cpu_per_request": ratio(
            ours["load"].cpu_ms_per_request or 0, peer["load"].cpu_ms_per_request or 0
        ),
        "get_vs_hello_load_rps": ratio(ours["load"].rps, results["hello-world GET /"]["load"].rps),
        "post_vs_get_alone_p50_floor": ratio(ours["alone"].p50_ms + commit_ms, ours["alone"].p50_ms),
    }
    print(
        "\nratios (goal: GET latency <= 1x the peer, throughput >= 1x, p99 <= 1x; POST latency <= 2x GET):\n"
        f"  ours GET / peer, alone p50 latency  : {ratios['get_vs_peer_alone_p50']}\n"
        f"  ours GET / peer, load req/s         : {ratios['get_vs_peer_load_rps']}\n"
        f"  ours GET / peer, load p99 latency   : {ratios['get_vs_peer_load_p99']}\n"
        f"  behind POST / GET, alone p50 latency: {ratios['post_vs_get_alone_p50']}\n"
        f"  behind POST / GET, load req/s       : {ratios['post_vs_get_load_rps']}\n"
        f"  head POST / GET, alone p50 latency  : {ratios['head_post_vs_get_alone_p50']}\n"
        f"  head POST / GET, load req/s         : {ratios['head_post_vs_get_load_rps']}\n"
        f"  ours GET / peer, server CPU per req : {ratios['get_vs_peer_cpu_per_request']}\n"
        f"  ours GET / hello-world, load req/s  : {ratios['get_vs_hello_load_rps']}\n"
        f"\na durable commit (one-row INSERT, autocommit) on this database: p50 {commit_ms:.2f} ms, so a\n"
        f"POST (which must commit once) takes at least a GET plus a commit: POST / GET >= "
        f"{ratios['post_vs_get_alone_p50_floor']} here\n"
        f"a submission's BEGIN, two statements and COMMIT (trivial SQL), p50 {four_trips_ms:.3f} ms as four\n"
        f"round trips, {pipelined_ms:.3f} ms pipelined into two syncs (the most pipelining could save here)"
    )
    if in_process:
        submitted, read = in_process["submit_request + commit"], in_process["get_request_view"]
        ratios["in_process_post_vs_get_cpu"] = ratio(submitted.cpu_ms, read.cpu_ms)
        ratios["in_process_post_vs_get_p50"] = ratio(submitted.p50_ms, read.p50_ms)
        lines = [f"  {c.name:24}: p50 {c.p50_ms:.3f} ms, CPU {c.cpu_ms:.3f} ms" for c in in_process.values()]
        print(
            f"\nthe persistence layer alone, called in this process ({submitted.calls} calls each, no HTTP):",
            *lines,
            f"  submission / status read: CPU x{ratios['in_process_post_vs_get_cpu']}, "
            f"p50 x{ratios['in_process_post_vs_get_p50']}",
            sep="\n",
        )
    write_json_report(
        args,
        load_before,
        load_after,
        results={n: {m: asdict(r) for m, r in modes.items()} for n, modes in results.items()},
        in_process={n: asdict(c) for n, c in in_process.items()},
        ratios=ratios,
        durable_commit_p50_ms=round(commit_ms, 3),
        submission_round_trips_p50_ms={
            "four_round_trips": round(four_trips_ms, 4),
            "pipelined": round(pipelined_ms, 4),
        },
    )
    bad = [r for modes in results.values() for r in modes.values() if r.errors]
    if bad:
        print(
            f"\nwarning: errors in {', '.join(r.name for r in bad)}: "
            f"{'; '.join(str(r.statuses) for r in bad)}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
