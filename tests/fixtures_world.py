"""Fixtures for the world tests."""
