"""Fixtures for the services tests."""
