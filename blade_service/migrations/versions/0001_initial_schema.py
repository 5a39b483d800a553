"""Initial schema: every table of persistence/models.py, and triggers that keep the audit log append-only.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "audit_entries",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=True),
        sa.Column("actor", sa.String(length=255), nullable=False),
        sa.Column("actor_key_id", sa.String(length=40), nullable=True),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("subject_type", sa.String(length=32), nullable=False),
        sa.Column("subject_id", sa.String(length=255), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("prev_hash", sa.String(length=64), nullable=False),
        sa.Column("hash", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_entries")),
        sa.UniqueConstraint("hash", name=op.f("uq_audit_entries_hash")),
        sa.UniqueConstraint("prev_hash", name=op.f("uq_audit_entries_prev_hash")),
    )
    op.create_index(op.f("ix_audit_entries_action"), "audit_entries", ["action"])
    op.create_index(op.f("ix_audit_entries_subject_id"), "audit_entries", ["subject_id"])
    op.create_index(op.f("ix_audit_entries_tenant_id"), "audit_entries", ["tenant_id"])

    op.create_table(
        "tenants",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
        sa.UniqueConstraint("name", name=op.f("uq_tenants_name")),
    )
    op.create_table(
        "worker_heartbeats",
        sa.Column("worker_name", sa.String(length=255), nullable=False),
        sa.Column("queues", sa.JSON(), nullable=False),
        sa.Column("hostname", sa.String(length=255), nullable=True),
        sa.Column("pid", sa.Integer(), nullable=True),
        sa.Column("current_request_id", sa.String(length=40), nullable=True),
        sa.Column("info", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("alive", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("worker_name", name=op.f("pk_worker_heartbeats")),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("scopes", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_api_keys_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant_id"), "api_keys", ["tenant_id"])

    op.create_table(
        "base_models",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("source", sa.String(length=1024), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=True),
        sa.Column("description", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_base_models_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_base_models")),
        sa.UniqueConstraint("name", name=op.f("uq_base_models_name")),
    )
    op.create_index(op.f("ix_base_models_tenant_id"), "base_models", ["tenant_id"])

    op.create_table(
        "datasets",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("format", sa.String(length=32), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.Column("storage_key", sa.String(length=512), nullable=False),
        sa.Column("created_by_key_id", sa.String(length=40), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_datasets_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_datasets")),
    )
    op.create_index(op.f("ix_datasets_sha256"), "datasets", ["sha256"])
    op.create_index(op.f("ix_datasets_tenant_id"), "datasets", ["tenant_id"])

    op.create_table(
        "unlearn_requests",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("base_model_id", sa.String(length=40), nullable=False),
        sa.Column("forget_dataset_id", sa.String(length=40), nullable=False),
        sa.Column("retain_dataset_id", sa.String(length=40), nullable=False),
        sa.Column("method", sa.String(length=32), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=False),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("request_fingerprint", sa.String(length=64), nullable=False),
        sa.Column("queue_seq", sa.BigInteger(), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "queued",
                "running",
                "evaluating",
                "succeeded",
                "failed",
                "cancelling",
                "cancelled",
                name="requeststatus",
                native_enum=False,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("total_steps", sa.Integer(), nullable=True),
        sa.Column("run_status", sa.String(length=16), nullable=True),
        sa.Column("error_code", sa.String(length=64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("lease_owner", sa.String(length=255), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("checkpoint_key", sa.String(length=512), nullable=True),
        sa.Column("metrics_before", sa.JSON(), nullable=True),
        sa.Column("metrics_after", sa.JSON(), nullable=True),
        sa.Column("created_by_key_id", sa.String(length=40), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancel_requested_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["base_model_id"], ["base_models.id"], name=op.f("fk_unlearn_requests_base_model_id_base_models")
        ),
        sa.ForeignKeyConstraint(
            ["forget_dataset_id"],
            ["datasets.id"],
            name=op.f("fk_unlearn_requests_forget_dataset_id_datasets"),
        ),
        sa.ForeignKeyConstraint(
            ["retain_dataset_id"],
            ["datasets.id"],
            name=op.f("fk_unlearn_requests_retain_dataset_id_datasets"),
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_unlearn_requests_tenant_id_tenants")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_unlearn_requests")),
        sa.UniqueConstraint(
            "base_model_id", "queue_seq", name=op.f("uq_unlearn_requests_base_model_id_queue_seq")
        ),
        sa.UniqueConstraint(
            "tenant_id", "idempotency_key", name=op.f("uq_unlearn_requests_tenant_id_idempotency_key")
        ),
    )
    op.create_index(op.f("ix_unlearn_requests_base_model_id"), "unlearn_requests", ["base_model_id"])
    op.create_index("ix_unlearn_requests_status_base_model", "unlearn_requests", ["status", "base_model_id"])
    op.create_index(op.f("ix_unlearn_requests_tenant_id"), "unlearn_requests", ["tenant_id"])

    op.create_table(
        "adapter_versions",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("base_model_id", sa.String(length=40), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column(
            "state",
            sa.Enum("active", "disabled", name="adapterstate", native_enum=False, length=16),
            nullable=False,
        ),
        sa.Column("request_id", sa.String(length=40), nullable=False),
        sa.Column("method", sa.String(length=32), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("size_bytes", sa.BigInteger(), nullable=True),
        sa.Column("storage_key", sa.String(length=512), nullable=False),
        sa.Column("forget_sha256", sa.String(length=64), nullable=False),
        sa.Column("retain_sha256", sa.String(length=64), nullable=False),
        sa.Column("hyperparameters", sa.JSON(), nullable=False),
        sa.Column("parent_stack", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("state_changed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("state_changed_by", sa.String(length=255), nullable=True),
        sa.Column("state_reason", sa.Text(), nullable=True),
        sa.ForeignKeyConstraint(
            ["base_model_id"], ["base_models.id"], name=op.f("fk_adapter_versions_base_model_id_base_models")
        ),
        sa.ForeignKeyConstraint(
            ["request_id"],
            ["unlearn_requests.id"],
            name=op.f("fk_adapter_versions_request_id_unlearn_requests"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapter_versions")),
        sa.UniqueConstraint(
            "base_model_id", "version", name=op.f("uq_adapter_versions_base_model_id_version")
        ),
        sa.UniqueConstraint("request_id", name=op.f("uq_adapter_versions_request_id")),
    )
    op.create_index(op.f("ix_adapter_versions_base_model_id"), "adapter_versions", ["base_model_id"])

    op.create_table(
        "training_events",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("request_id", sa.String(length=40), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("record", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["request_id"],
            ["unlearn_requests.id"],
            name=op.f("fk_training_events_request_id_unlearn_requests"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_training_events")),
        sa.UniqueConstraint("request_id", "step", name=op.f("uq_training_events_request_id_step")),
    )

    _audit_append_only_triggers()


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS audit_entries_append_only ON audit_entries")
        op.execute("DROP TRIGGER IF EXISTS audit_entries_no_truncate ON audit_entries")
        op.execute("DROP FUNCTION IF EXISTS blade_audit_append_only()")
    else:
        op.execute("DROP TRIGGER IF EXISTS audit_entries_no_update")
        op.execute("DROP TRIGGER IF EXISTS audit_entries_no_delete")
    op.drop_table("training_events")
    op.drop_index(op.f("ix_adapter_versions_base_model_id"), table_name="adapter_versions")

    op.drop_table("adapter_versions")
    op.drop_index(op.f("ix_unlearn_requests_tenant_id"), table_name="unlearn_requests")
    op.drop_index("ix_unlearn_requests_status_base_model", table_name="unlearn_requests")
    op.drop_index(op.f("ix_unlearn_requests_base_model_id"), table_name="unlearn_requests")

    op.drop_table("unlearn_requests")
    op.drop_index(op.f("ix_datasets_tenant_id"), table_name="datasets")
    op.drop_index(op.f("ix_datasets_sha256"), table_name="datasets")

    op.drop_table("datasets")
    op.drop_index(op.f("ix_base_models_tenant_id"), table_name="base_models")

    op.drop_table("base_models")
    op.drop_index(op.f("ix_api_keys_tenant_id"), table_name="api_keys")

    op.drop_table("api_keys")
    op.drop_table("worker_heartbeats")
    op.drop_table("tenants")
    op.drop_index(op.f("ix_audit_entries_tenant_id"), table_name="audit_entries")
    op.drop_index(op.f("ix_audit_entries_subject_id"), table_name="audit_entries")
    op.drop_index(op.f("ix_audit_entries_action"), table_name="audit_entries")

    op.drop_table("audit_entries")


def _audit_append_only_triggers() -> None:
    """UPDATE and DELETE on audit_entries fail in the database (the hash chain detects what gets past)."""
    if op.get_bind().dialect.name == "postgresql":
        op.execute(
            "CREATE FUNCTION blade_audit_append_only() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'audit_entries is append-only'; END $$"
        )
        op.execute(
            "CREATE TRIGGER audit_entries_append_only BEFORE UPDATE OR DELETE ON audit_entries "
            "FOR EACH ROW EXECUTE FUNCTION blade_audit_append_only()"
        )
        op.execute(
            "CREATE TRIGGER audit_entries_no_truncate BEFORE TRUNCATE ON audit_entries "
            "FOR EACH STATEMENT EXECUTE FUNCTION blade_audit_append_only()"
        )
    elif op.get_bind().dialect.name == "sqlite":
        for event in ("UPDATE", "DELETE"):
            op.execute(
                f"CREATE TRIGGER audit_entries_no_{event.lower()} BEFORE {event} ON audit_entries "
                "BEGIN SELECT RAISE(ABORT, 'audit_entries is append-only'); END"
            )
