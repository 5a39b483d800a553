"""Fixtures for the engine tests."""
