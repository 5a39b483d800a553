"""Stacks: the unlearning policy, canary set and pinned hub revision of a base model, the gate verdict of a
request, compacted adapter versions (no request, a lineage) and the stack operations (compaction) that make
them.

Revision ID: 0003_stacks
Revises: 0002_trust
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_stacks"
down_revision: str | None = "0002_trust"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("base_models") as batch:
        batch.add_column(sa.Column("policy", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("canary_dataset_id", sa.String(length=40), nullable=True))
        batch.add_column(sa.Column("revision", sa.String(length=255), nullable=True))
        batch.create_foreign_key(
            op.f("fk_base_models_canary_dataset_id_datasets"), "datasets", ["canary_dataset_id"], ["id"]
        )
    with op.batch_alter_table("unlearn_requests") as batch:
        batch.add_column(sa.Column("gate", sa.JSON(), nullable=True))
    with op.batch_alter_table("adapter_versions") as batch:
        batch.alter_column("request_id", existing_type=sa.String(length=40), nullable=True)
        batch.add_column(sa.Column("kind", sa.String(length=16), nullable=False, server_default="request"))
        batch.add_column(sa.Column("lineage", sa.JSON(), nullable=True))

    op.create_table(
        "stack_operations",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("base_model_id", sa.String(length=40), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("error_code", sa.String(length=64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("created_by", sa.String(length=255), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("finished_at", _TS, nullable=True),
        sa.ForeignKeyConstraint(
            ["base_model_id"], ["base_models.id"], name=op.f("fk_stack_operations_base_model_id_base_models")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_stack_operations")),
    )
    op.create_index(
        op.f("ix_stack_operations_base_model_id"), "stack_operations", ["base_model_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_stack_operations_base_model_id"), table_name="stack_operations")
    op.drop_table("stack_operations")
    with op.batch_alter_table("adapter_versions") as batch:
        batch.drop_column("lineage")
        batch.drop_column("kind")
        batch.alter_column("request_id", existing_type=sa.String(length=40), nullable=False)
    with op.batch_alter_table("unlearn_requests") as batch:
        batch.drop_column("gate")
    with op.batch_alter_table("base_models") as batch:
        batch.drop_constraint(op.f("fk_base_models_canary_dataset_id_datasets"), type_="foreignkey")
        batch.drop_column("canary_dataset_id")
        batch.drop_column("revision")
        batch.drop_column("policy")
