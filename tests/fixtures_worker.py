"""Fixtures for the worker tests."""
