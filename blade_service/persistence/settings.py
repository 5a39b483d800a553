"""All service configuration, from environment variables (prefix `BLADE_`).

No other module reads os.environ.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BLADE_", env_file=".env", extra="ignore")

    # Where things live. The embedded default keeps everything under data_dir.
    data_dir: Path = Path("./var")
    database_url: str = ""  # default: sqlite under data_dir; production: postgresql+psycopg://...
    broker_url: str = ""  # default: a server-less SQLite broker under data_dir; production: redis://...
    result_backend: str = ""  # default: SQLite under data_dir; production: redis://...

    # Artifact storage (datasets, adapters, checkpoints).
    storage_backend: Literal["local", "s3"] = "local"
    storage_root: Path | None = None  # local backend; default data_dir/artifacts
    s3_bucket: str = "blade-artifacts"
    s3_endpoint_url: str | None = None
    s3_prefix: str = ""

    # Security.
    bootstrap_admin_key: str | None = None  # created as an admin key on first start
    # Ed25519 key of deletion certificates (base64 32-byte seed or PEM); default: a random one in data_dir.
    certificate_signing_key: str = Field(default="", repr=False)
    dashboard_session_hours: float = 12.0  # a dashboard sign-in lasts this long
    # How long a forget dataset's bytes outlive its request, unless its base model says otherwise
    # (persistence/retention.py): gone right after a success; kept a few days after a failure for a retry.
    forget_retention_success_s: int = 0
    forget_retention_failure_s: int = 3 * 24 * 3600
    # A dataset no request and no base model's canary names is purged this long after its upload: forget data
    # uploaded for a request that was never made would otherwise stay forever. 0: kept until deleted.
    unused_dataset_retention_s: int = Field(default=7 * 24 * 3600, ge=0)
    # Webhooks (persistence/webhooks.py): never to loopback addresses unless the operator allows it here.
    webhook_allow_loopback: bool = False
    webhook_retry_base_s: float = 10.0  # first retry after this; each further one waits twice as long
    webhook_max_attempts: int = 8
    webhook_interval_s: float = 5.0  # how often the maintenance worker sends due deliveries
    max_upload_bytes: int = 50 * 1024 * 1024

    # Worker behaviour.
    device: str | None = None  # e.g. "cuda:0"; None picks CUDA when present
    task_soft_time_limit_s: int = 6 * 3600
    task_time_limit_s: int = 6 * 3600 + 300
    lease_seconds: int = 60  # a running request's lease; the heartbeat renews it
    heartbeat_seconds: int = 10
    checkpoint_every: int = 25
    # A BLADE run that collapses (its retain loss past collapse_loss) starts over at half its eta_out, up to
    # this many times, unless the request set eta_out itself (worker/training.py).
    collapse_retries: int = Field(default=1, ge=0, le=5)
    # New tokens per greedy generation when the worker measures a request's ROUGE (before/after metrics, the
    # policy gate's canary, earlier forget sets): OpenUnlearning's 200 (its configs/generation/default.yaml).
    eval_max_new_tokens: int = Field(default=200, ge=1, le=1024)
    generate_timeout_s: float = 60.0
    export_timeout_s: float = 600.0  # GET /base-models/{name}/export waits this long for the worker
    # POST /base-models asks this hub's public model API whether a hub-id source exists (HF_TOKEN if set);
    # unreachable within the timeout: registered with a warning.
    hub_url: str = "https://huggingface.co"
    hub_check_timeout_s: float = 3.0
    reconcile_interval_s: int = 60
    audit_check_interval_s: int = (
        600  # the reconciler re-verifies the audit chain and signed heads this often
    )
    requeue_after_s: int = 300  # the reconciler re-publishes a queued head request whose task is this old
    max_attempts: int = 5  # deliveries of one request (worker crashes) before it fails as a crash loop
    worker_metrics_port: int = 0  # Prometheus metrics of a worker on this port (0: not served); docker: 9808

    # HTTP.
    host: str = "127.0.0.1"
    port: int = 8000
    # uvicorn worker processes of `blade api` (0: one per CPU core, what compose sets). Each keeps its own
    # API-key cache: a revocation reaches the others at once (key_revocations.py, LISTEN/NOTIFY).
    api_workers: int = Field(default=1, ge=0)
    # Prometheus `/metrics` of the API on its own port (compose: 9100, not published to the host), so the
    # public port never serves it; 0 serves it on the API's own port, as `make run` does.
    metrics_port: int = 0
    # The client verbs (`blade submit/status/rollback`): where the API is and the key to call it with.
    api_url: str = ""  # default http://{host}:{port}
    api_key: str | None = Field(default=None, repr=False)
    log_level: str = "INFO"

    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'blade.db').resolve()}"

    def resolved_broker_url(self) -> str:
        return self.broker_url or f"sqla+sqlite:///{(self.data_dir / 'broker.db').resolve()}"

    def resolved_result_backend(self) -> str:
        return self.result_backend or f"db+sqlite:///{(self.data_dir / 'results.db').resolve()}"

    def resolved_api_workers(self) -> int:
        if self.api_workers:
            return self.api_workers
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def resolved_storage_root(self) -> Path:
        return (self.storage_root or self.data_dir / "artifacts").resolve()


@lru_cache
def get_settings() -> Settings:
    return Settings()
