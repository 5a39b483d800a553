"""Migrations, run by `persistence.db.upgrade_to_head` at start-up, or `alembic -c migrations/alembic.ini`."""
