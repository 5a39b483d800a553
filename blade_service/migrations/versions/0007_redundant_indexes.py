"""Drop the two single-column indexes of `unlearn_requests` that a composite index already leads with:
`base_model_id` (the unique (base_model_id, queue_seq)) and `tenant_id` (the unique (tenant_id,
idempotency_key) and (tenant_id, created_at)). Before PostgreSQL has analysed the table, the planner numbered
each submission by reading every request of its base model through `ix_unlearn_requests_base_model_id` and
sorting them, instead of reading the last entry of the unique index (docs/performance.md); and every POST
wrote both. No table changes.

Revision ID: 0007_redundant_indexes
Revises: 0006_submission_relay
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007_redundant_indexes"
down_revision: str | None = "0006_submission_relay"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_DROPPED = {
    "ix_unlearn_requests_base_model_id": "base_model_id",
    "ix_unlearn_requests_tenant_id": "tenant_id",
}


def upgrade() -> None:
    for name in _DROPPED:
        op.drop_index(name, table_name="unlearn_requests")


def downgrade() -> None:
    for name, column in _DROPPED.items():
        op.create_index(name, "unlearn_requests", [column])
