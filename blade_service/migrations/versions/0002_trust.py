"""Trust and compliance: immutable Ed25519 certificates and their published keys, forget-data purge
(dataset purge marks, per-base-model retention), dashboard sessions, webhooks and their delivery log.

Revision ID: 0002_trust
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_trust"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("datasets") as batch:
        batch.add_column(sa.Column("purged_at", _TS, nullable=True))
        batch.add_column(sa.Column("purge_reason", sa.Text(), nullable=True))
    with op.batch_alter_table("base_models") as batch:
        batch.add_column(sa.Column("forget_retention_success_s", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("forget_retention_failure_s", sa.Integer(), nullable=True))

    op.create_table(
        "certificates",
        sa.Column("request_id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("document", sa.Text(), nullable=False),
        sa.Column("issued_at", _TS, nullable=False),
        sa.ForeignKeyConstraint(
            ["request_id"], ["unlearn_requests.id"], name=op.f("fk_certificates_request_id_unlearn_requests")
        ),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_certificates")),
    )
    op.create_index(op.f("ix_certificates_tenant_id"), "certificates", ["tenant_id"], unique=False)
    _immutable("certificates")

    op.create_table(
        "signing_keys",
        sa.Column("key_id", sa.String(length=32), nullable=False),
        sa.Column("algorithm", sa.String(length=16), nullable=False),
        sa.Column("public_key", sa.String(length=128), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("retired_at", _TS, nullable=True),
        sa.PrimaryKeyConstraint("key_id", name=op.f("pk_signing_keys")),
    )

    op.create_table(
        "dashboard_sessions",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("key_id", sa.String(length=40), nullable=False),
        sa.Column("csrf_token", sa.String(length=64), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("expires_at", _TS, nullable=False),
        sa.Column("last_seen_at", _TS, nullable=True),
        sa.ForeignKeyConstraint(
            ["key_id"],
            ["api_keys.id"],
            name=op.f("fk_dashboard_sessions_key_id_api_keys"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dashboard_sessions")),
    )
    op.create_index(op.f("ix_dashboard_sessions_key_id"), "dashboard_sessions", ["key_id"], unique=False)

    op.create_table(
        "webhook_endpoints",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("url", sa.String(length=2048), nullable=False),
        sa.Column("secret", sa.String(length=128), nullable=False),
        sa.Column("events", sa.JSON(), nullable=False),
        sa.Column("allow_loopback", sa.Boolean(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("disabled_at", _TS, nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_webhook_endpoints_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_endpoints")),
    )
    op.create_index(op.f("ix_webhook_endpoints_tenant_id"), "webhook_endpoints", ["tenant_id"], unique=False)

    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("endpoint_id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("event", sa.String(length=64), nullable=False),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("next_attempt_at", _TS, nullable=True),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("delivered_at", _TS, nullable=True),
        sa.ForeignKeyConstraint(
            ["endpoint_id"],
            ["webhook_endpoints.id"],
            name=op.f("fk_webhook_deliveries_endpoint_id_webhook_endpoints"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_webhook_deliveries")),
    )
    op.create_index(
        op.f("ix_webhook_deliveries_endpoint_id"), "webhook_deliveries", ["endpoint_id"], unique=False
    )
    op.create_index(
        op.f("ix_webhook_deliveries_tenant_id"), "webhook_deliveries", ["tenant_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_webhook_deliveries_tenant_id"), table_name="webhook_deliveries")
    op.drop_index(op.f("ix_webhook_deliveries_endpoint_id"), table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_index(op.f("ix_webhook_endpoints_tenant_id"), table_name="webhook_endpoints")
    op.drop_table("webhook_endpoints")
    op.drop_index(op.f("ix_dashboard_sessions_key_id"), table_name="dashboard_sessions")
    op.drop_table("dashboard_sessions")
    op.drop_table("signing_keys")
    _drop_immutable("certificates")
    op.drop_index(op.f("ix_certificates_tenant_id"), table_name="certificates")
    op.drop_table("certificates")
    with op.batch_alter_table("base_models") as batch:
        batch.drop_column("forget_retention_failure_s")
        batch.drop_column("forget_retention_success_s")
    with op.batch_alter_table("datasets") as batch:
        batch.drop_column("purge_reason")
        batch.drop_column("purged_at")


def _immutable(table: str) -> None:
    """UPDATE and DELETE on `table` fail in the database: a certificate, once issued, stays as issued."""
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            f"CREATE FUNCTION blade_{table}_immutable() RETURNS trigger LANGUAGE plpgsql AS "
            f"$$ BEGIN RAISE EXCEPTION '{table} rows are immutable'; END $$"
        )
        op.execute(
            f"CREATE TRIGGER {table}_immutable BEFORE UPDATE OR DELETE ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION blade_{table}_immutable()"
        )
    elif op.get_bind().dialect.name == "sqlite":
        for event in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER {table}_no_{event.lower()} BEFORE {event} ON {table} "
                f"BEGIN SELECT RAISE(ABORT, '{table} rows are immutable'); END"
            )


def _drop_immutable(table: str) -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP TRIGGER IF EXISTS {table}_immutable ON {table}")
        op.execute(f"DROP FUNCTION IF EXISTS blade_{table}_immutable()")
    else:
        for event in ("update", "delete"):
            op.execute(f"DROP TRIGGER IF EXISTS {table}_no_{event}")
