"""Hub-id base models, torch-free: parse `org/name[@revision]`, and ask the hub's public model API whether the
repository (and revision) exists. The API checks at registration; the worker loads through huggingface_hub."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import httpx

from blade_service.contracts.hub_ids import HUB_ID
from blade_service.persistence.errors import Invalid

log = logging.getLogger("blade.hub")

# A commit sha, tag or branch (git ref rules, simplified): no whitespace, '..', '~^:?*[\' or leading '-'/'/'.
REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._/+-]{0,254}")  # fullmatch
LOCAL_PREFIXES = ("/", "./", "../", "~")


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None = None


def is_local_path(source: str) -> bool:
    """A path (absolute, relative with ./ or ../, or an existing directory here), never a hub id."""
    return source.startswith(LOCAL_PREFIXES) or Path(source).expanduser().is_dir()


def is_hub_snapshot(path: str | Path) -> bool:
    """A directory of the hub cache layout `models--org--name/snapshots/<commit>` (a resolved hub model)."""
    p = Path(path)
    return p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--")


def parse(source: str, revision: str | None = None) -> HubRef:
    """`org/name` or `org/name@revision`, with `revision` (the request field) pinning it; Invalid naming
    `source` or `revision` when malformed or when the two revisions disagree."""
    repo_id, at, inline = source.strip().partition("@")
    if not HUB_ID.fullmatch(repo_id) or "--" in repo_id or ".." in repo_id:
        raise Invalid(
            f"source: {source!r} is not a local directory, a storage key or a hub id of the form "
            "org/name[@revision] (letters, digits, '-', '_', '.'; at most 96 characters a part)",
            field="source",
        )
    pinned = (revision or "").strip() or None
    if at and not inline:
        raise Invalid(f"source: {source!r} has an empty revision after '@'", field="source")
    if inline and pinned and inline != pinned:
        raise Invalid(
            f"revision: {pinned!r} disagrees with the revision {inline!r} in source", field="revision"
        )
    pinned = pinned or inline or None
    malformed = pinned is not None and not REVISION.fullmatch(pinned)
    if pinned is not None and (malformed or ".." in pinned or pinned.endswith((".", "/"))):
        raise Invalid(f"revision: {pinned!r} is not a commit, tag or branch name", field="revision")
    return HubRef(repo_id, pinned)


def _hub_message(response: httpx.Response) -> str:
    """The hub's own words: its X-Error-Message header or the body's `error`, else the status line."""
    message = response.headers.get("x-error-message")
    if not message:
        try:
            body = response.json()
            message = body.get("error") if isinstance(body, dict) else None
        except ValueError:
            message = None
    return str(message or f"HTTP {response.status_code} {response.reason_phrase}".strip())


def check_exists(ref: HubRef, *, hub_url: str, timeout_s: float, token: str | None = None) -> str | None:
    """None when the hub has `ref` (repository and revision); a warning when the hub cannot be asked
    (unreachable, timeout, 5xx, 429); Invalid naming `source` (or `revision`) on 401/403/404."""
    url = f"{hub_url.rstrip('/')}/api/models/{ref.repo_id}"
    if ref.revision:
        url += f"/revision/{quote(ref.revision, safe='')}"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.get(url, headers=headers, timeout=timeout_s, follow_redirects=True)
    except httpx.HTTPError as exc:
        return _unchecked(ref, hub_url, f"{type(exc).__name__}: {exc}")
    if response.status_code in (401, 403, 404):
        message = _hub_message(response)
        # With a revision pinned, a 404 that is not about the repository is about the revision.
        about_repo = response.status_code != 404 or "repo" in message.lower() or not ref.revision
        field = "source" if about_repo else "revision"
        what = f"{ref.repo_id}@{ref.revision}" if ref.revision else ref.repo_id
        raise Invalid(
            f"{field}: the hub at {hub_url} has no accessible model {what!r} (HTTP {response.status_code}: "
            f"{message}); a private or gated model needs HF_TOKEN set on the API and the workers",
            field=field,
        )
    if response.status_code >= 400:
        return _unchecked(ref, hub_url, f"HTTP {response.status_code}: {_hub_message(response)}")
    return None


def _unchecked(ref: HubRef, hub_url: str, why: str) -> str:
    warning = (
        f"source: the hub at {hub_url} could not be asked whether {ref.repo_id!r} exists ({why}); "
        "registered unchecked, a worker will fail the request as base_model_unavailable if it is not there"
    )
    log.warning("base_model.hub_unchecked", extra={"repo_id": ref.repo_id, "reason": why})
    return warning


def hub_token() -> str | None:
    """The hub token of this process (HF_TOKEN, the variable huggingface_hub reads too)."""
    return os.environ.get("HF_TOKEN") or None


def check_source(
    source: str,
    revision: str | None,
    *,
    is_storage_key: Callable[[str], bool],
    hub_url: str,
    timeout_s: float,
    token: str | None = None,
) -> tuple[str | None, str | None]:
    """(revision to record, warning) for a base model's `source` at registration: a local path or a storage
    key as is (no revision allowed); anything else must be a well-formed hub id the hub does not deny."""
    if is_local_path(source) or is_storage_key(source):
        if (revision or "").strip():
            raise Invalid("revision: only a hub-id source has a revision", field="revision")
        if is_storage_key(source):
            return None, None
        return None, (  # the API cannot see the workers' disks: say so rather than pass it as checked
            f"source {source!r} is a directory on the workers, not checked here: the first request fails "
            "as base_model_unavailable if the workers cannot read a model there"
        )
    ref = parse(source, revision)
    return ref.revision, check_exists(ref, hub_url=hub_url, timeout_s=timeout_s, token=token)
