"""Base-model names per tenant: one tenant's name no longer collides with another tenant's private model, so a
409 no longer tells a tenant that another tenant holds a model of that name. The global unique constraint on
`base_models.name` becomes unique (tenant_id, name) plus a partial unique index over the shared models' names;
`base_models.register` keeps a private name from equalling a shared one.

Revision ID: 0008_tenant_model_names
Revises: 0007_redundant_indexes
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_tenant_model_names"
down_revision: str | None = "0007_redundant_indexes"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SHARED = sa.text("tenant_id IS NULL")


def upgrade() -> None:
    with op.batch_alter_table("base_models") as batch:
        batch.drop_constraint("uq_base_models_name", type_="unique")
        batch.create_unique_constraint("uq_base_models_tenant_id_name", ["tenant_id", "name"])
    op.create_index(
        "uq_base_models_shared_name",
        "base_models",
        ["name"],
        unique=True,
        postgresql_where=_SHARED,
        sqlite_where=_SHARED,
    )


def downgrade() -> None:
    """Fails while two tenants hold models of one name: which to rename is the operator's call."""
    op.drop_index("uq_base_models_shared_name", table_name="base_models")
    with op.batch_alter_table("base_models") as batch:
        batch.drop_constraint("uq_base_models_tenant_id_name", type_="unique")
        batch.create_unique_constraint("uq_base_models_name", ["name"])
