"""`molora keys create|list|revoke --file PATH`: manage the hashed API key file.

`create` prints the new key once, on stdout; only its salted hash is written to the file, so a
lost key is revoked and replaced, never recovered.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deployments.access.auth import (
    KeyFile,
    dump_entry_json,
    new_key,
    read_key_file,
    write_key_file,
)


def _create(args: argparse.Namespace) -> int:
    path = Path(args.file)
    keys = read_key_file(path)
    key, entry = new_key(args.tenant, admin=args.admin)
    write_key_file(path, KeyFile(keys=[*keys.keys, entry]))
    role = "admin key" if args.admin else "key"
    print(f"created {role} {entry.key_id} for tenant {entry.tenant} in {path}", file=sys.stderr)
    print("store it now: it is shown only once", file=sys.stderr)
    print(key)
    return 0


def _list(args: argparse.Namespace) -> int:
    for entry in read_key_file(Path(args.file)).keys:
        if args.json:
            print(dump_entry_json(entry))
        else:
            admin = "  admin" if entry.admin else ""
            created = f"  {entry.created:%Y-%m-%d %H:%M:%S}" if entry.created else ""
            print(f"{entry.key_id}  tenant={entry.tenant}{admin}{created}")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    path = Path(args.file)
    keys = read_key_file(path)
    kept = [k for k in keys.keys if k.key_id != args.key_id]
    if len(kept) == len(keys.keys):
        print(f"error: no key {args.key_id} in {path}", file=sys.stderr)
        return 4
    write_key_file(path, KeyFile(keys=kept))
    print(f"revoked {args.key_id}", file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("keys", help="API keys of the OpenAI endpoint (hashed file)")
    commands = parser.add_subparsers(dest="keys_command", required=True)

    p = commands.add_parser("create", help="create a key for a tenant; prints it once")
    p.add_argument("--tenant", required=True, help="tenant the key acts for")
    p.add_argument("--admin", action="store_true", help="may yank/unyank over HTTP")
    p.add_argument("--file", required=True, help="key file (created if missing, mode 0600)")
    p.set_defaults(func=_create)

    p = commands.add_parser("list", help="key ids, tenants and roles (never hashes)")
    p.add_argument("--file", required=True)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_list)

    p = commands.add_parser("revoke", help="remove a key by id (servers reload the file)")
    p.add_argument("key_id")
    p.add_argument("--file", required=True)
    p.set_defaults(func=_revoke)
