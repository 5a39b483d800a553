"""The submission relay: a request keeps the trace id of the HTTP call that submitted it, so the worker that
publishes its task (worker/submission_relay.py) passes it on to the worker that runs it (docs/operations.md,
Logs).

Revision ID: 0006_submission_relay
Revises: 0005_speed
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_submission_relay"
down_revision: str | None = "0005_speed"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("unlearn_requests", sa.Column("trace_id", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("unlearn_requests") as batch:
        batch.drop_column("trace_id")
