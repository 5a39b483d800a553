"""`blade verify-certificate FILE`: check a deletion certificate's Ed25519 signature with public keys only.

Where the public key comes from, first match wins:
    --public-key KEY        one key: base64 (as published), hex, or a PEM block
    --public-key-file F     the same, from a file
    --keys-file F           a saved copy of GET /certificate-keys
    (default)               GET {BLADE_API_URL or --api-url}/certificate-keys (public; no API key needed)

Exit status 0 and "valid" when the certificate is exactly what the key named in its signature signed; 1 and
the reason when it is not (altered, unknown key, not a certificate); 2 when a file or the keys cannot be read.
A valid certificate of a run that did not converge says so on a second line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "verify-certificate",
        help="verify a deletion certificate's Ed25519 signature (public key only)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("file", type=Path, help="the certificate JSON (GET /unlearn-requests/{id}/certificate)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--public-key", help="the Ed25519 public key (base64, hex or PEM)")
    group.add_argument("--public-key-file", type=Path, help="a file holding the public key")
    group.add_argument("--keys-file", type=Path, help="a saved GET /certificate-keys document")
    p.add_argument("--api-url", help="where to fetch the published keys (default: BLADE_API_URL)")
    p.set_defaults(func=run)


def _read(path: Path) -> str:
    from blade_service.cli.main import CliError

    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CliError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"{path}: cannot read it ({exc})") from None


def _keyset(doc: Any, where: str) -> dict[str, str]:
    from blade_service.cli.main import CliError

    keys = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(keys, list):
        raise CliError(f"{where}: not a certificate-keys document (no 'keys' list)")
    return {k["key_id"]: k["public_key"] for k in keys if isinstance(k, dict) and "key_id" in k}


def _published_keys(api_url: str | None) -> dict[str, str]:
    import httpx

    from blade_service.cli.main import CliError
    from blade_service.persistence.settings import get_settings

    settings = get_settings()
    base = (api_url or settings.api_url or f"http://{settings.host}:{settings.port}").rstrip("/")
    url = f"{base}/certificate-keys"
    try:
        response = httpx.get(url, timeout=30)
        response.raise_for_status()
        return _keyset(response.json(), url)
    except (httpx.HTTPError, ValueError) as exc:
        raise CliError(
            f"cannot fetch the published keys from {url} ({exc}); pass --public-key or --keys-file"
        ) from None


def run(args: argparse.Namespace) -> int:
    from blade_service.cli.main import CliError
    from blade_service.persistence.certificates import verify_certificate

    try:
        doc = json.loads(_read(args.file))
    except json.JSONDecodeError as exc:
        raise CliError(f"{args.file}: not a JSON document ({exc})") from None

    keys: str | dict[str, str]
    if args.public_key is not None:
        keys = args.public_key
    elif args.public_key_file is not None:
        keys = _read(args.public_key_file)
    elif args.keys_file is not None:
        try:
            keys = _keyset(json.loads(_read(args.keys_file)), str(args.keys_file))
        except json.JSONDecodeError as exc:
            raise CliError(f"{args.keys_file}: not a JSON document ({exc})") from None
    else:
        keys = _published_keys(args.api_url)

    ok, reason = verify_certificate(doc, keys)
    if not ok:
        print(f"blade verify-certificate: INVALID: {args.file}: {reason}", file=sys.stderr)
        return 1
    req = doc.get("request", {})
    print(
        f"valid: certificate for request {req.get('id')} on base model "
        f"{doc.get('model', {}).get('base_model', {}).get('name')}, issued {doc.get('issued_at')}, "
        f"signed by {doc['signature']['key_id']}"
    )
    convergence = doc.get("convergence") or {}
    if convergence.get("converged") is False:
        print(f"warning: {convergence.get('note') or 'the run did not converge'}")
    return 0
