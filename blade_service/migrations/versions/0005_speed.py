"""Speed: the indexes that keep request lists, the dashboard overview and /metrics flat as history grows
(docs/performance.md, benchmarks/api_scale.py). No table changes.

Revision ID: 0005_speed
Revises: 0004_ux (0003_stacks until 0004_ux exists: the chain stays single-headed either way)
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa
from alembic import op

revision: str = "0005_speed"
# 0004_ux is written in parallel; this revision follows it once it exists, 0003_stacks before that.
down_revision: str | None = "0004_ux" if (Path(__file__).parent / "0004_ux.py").exists() else "0003_stacks"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_UNFINISHED = "status IN ('queued', 'running', 'evaluating', 'cancelling')"  # models.UNFINISHED_SQL
_FAILED = "status = 'failed'"


def upgrade() -> None:
    op.create_index("ix_unlearn_requests_tenant_created", "unlearn_requests", ["tenant_id", "created_at"])
    op.create_index(
        "ix_unlearn_requests_tenant_status_created", "unlearn_requests", ["tenant_id", "status", "created_at"]
    )
    op.create_index(
        "ix_unlearn_requests_failed",
        "unlearn_requests",
        ["tenant_id", "finished_at"],
        postgresql_where=sa.text(_FAILED),
        sqlite_where=sa.text(_FAILED),
    )
    op.create_index(
        "ix_unlearn_requests_unfinished",
        "unlearn_requests",
        ["base_model_id", "queue_seq"],
        postgresql_where=sa.text(_UNFINISHED),
        sqlite_where=sa.text(_UNFINISHED),
    )
    op.create_index("ix_unlearn_requests_finished_at", "unlearn_requests", ["finished_at"])
    op.create_index("ix_unlearn_requests_started_at", "unlearn_requests", ["started_at"])


def downgrade() -> None:
    for name in (
        "ix_unlearn_requests_started_at",
        "ix_unlearn_requests_finished_at",
        "ix_unlearn_requests_unfinished",
        "ix_unlearn_requests_failed",
        "ix_unlearn_requests_tenant_status_created",
        "ix_unlearn_requests_tenant_created",
    ):
        op.drop_index(name, table_name="unlearn_requests")
