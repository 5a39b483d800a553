"""Shared fixtures live in one module per area, loaded here."""

pytest_plugins = [
    "tests.fixtures_engine",
    "tests.fixtures_world",
    "tests.fixtures_services",
    "tests.fixtures_worker",
]
