"""Migrations, run by `persistence.db.upgrade_to_head` at start-up, or by hand:
`alembic -c blade_service/migrations/alembic.ini upgrade head`."""
