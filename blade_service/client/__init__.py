"""Typed Python client for the BLADE HTTP API (see `client.http`)."""

from blade_service.client.http import TERMINAL_STATES, ApiError, BladeClient

__all__ = ["TERMINAL_STATES", "ApiError", "BladeClient"]
