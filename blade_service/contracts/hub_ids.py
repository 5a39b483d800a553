"""What a hub model id looks like, torch-free: the API checks sources at registration with it, and the engine
tells a mistyped directory from a hub id with it."""

from __future__ import annotations

import re

# The hub's repo-name rules (huggingface_hub.utils.validate_repo_id): letters, digits, '-', '_', '.', at most
# 96 characters per part, no '--' or '..', not starting or ending with '-' or '.'.
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
HUB_ID = re.compile(rf"{_PART}/{_PART}")  # org/name, what the service registers (fullmatch)
_ANY_HUB_ID = re.compile(rf"(?:{_PART}/)?{_PART}")  # also the hub's older unscoped names (gpt2)


def could_be_hub_id(ref: str) -> bool:
    """`name` or `org/name` within the hub's naming rules."""
    return bool(_ANY_HUB_ID.fullmatch(ref)) and "--" not in ref and ".." not in ref
