"""`blade verify-certificate FILE [--key K | --key-file F]`: check a deletion certificate's signature.

Exit status 0 and "valid" when the certificate is exactly what the server signed; 1 and the reason when it is
not (altered, signed with another key, not a certificate); 2 when the file cannot be read.
Without --key the key comes from the same settings as the server (BLADE_SIGNING_KEY, else the installation key
under BLADE_DATA_DIR).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "verify-certificate",
        help="verify a deletion certificate's HMAC signature",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("file", type=Path, help="the certificate JSON (GET /unlearn-requests/{id}/certificate)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--key", help="the signing key (default: BLADE_SIGNING_KEY or the installation key)")
    group.add_argument("--key-file", type=Path, help="a file holding the signing key")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from cli.main import CliError
    from persistence.certificates import verify_certificate

    try:
        doc = json.loads(args.file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CliError(f"{args.file}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CliError(f"{args.file}: not a JSON document ({exc})") from None

    if args.key_file is not None:
        try:
            key = args.key_file.read_text().strip()
        except OSError as exc:
            raise CliError(f"{args.key_file}: cannot read the key file ({exc.strerror})") from None
    elif args.key is not None:
        key = args.key
    else:
        from persistence.certificates import resolve_signing_key
        from persistence.settings import get_settings

        key = resolve_signing_key(get_settings(), create=False)

    ok, reason = verify_certificate(doc, key)
    if not ok:
        print(f"blade verify-certificate: INVALID: {args.file}: {reason}", file=sys.stderr)
        return 1
    req = doc.get("request", {})
    print(
        f"valid: certificate for request {req.get('id')} on base model "
        f"{doc.get('model', {}).get('base_model', {}).get('name')}, issued {doc.get('issued_at')}"
    )
    return 0
