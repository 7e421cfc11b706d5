"""`trainyard token create|list|revoke`: the service's users, made on the state directory (no server needed; a
running service sees the change from its next request). See `service.users`."""

from __future__ import annotations

import argparse
import sys
import time

from trainyard.service import state_dir, users


def create(args: argparse.Namespace) -> int:
    try:
        token = users.create(state_dir.resolve(args.state_dir), args.name, admin=args.admin, max_cpus=args.max_cpus,
                             max_gpus=args.max_gpus)
    except users.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # The token alone on stdout (TOKEN=$(trainyard token create NAME)); the notice where a terminal shows it.
    print(f"user {args.name!r}{' (admin)' if args.admin else ''}: their token, shown this once (only its hash is "
          "kept); give it to them as TRAINYARD_TOKEN or --token:", file=sys.stderr)
    print(token)
    return 0


def list_users(args: argparse.Namespace) -> int:
    rows = [("NAME", "ROLE", "MAX_CPUS", "MAX_GPUS", "CREATED"),
            (users.ADMIN, "admin", "-", "-", "(the state directory's token)")]
    for u in users.read(state_dir.resolve(args.state_dir)):
        rows.append((u.name, "admin" if u.admin else "user", _limit(u.max_cpus), _limit(u.max_gpus),
                     time.strftime("%Y-%m-%d %H:%M", time.localtime(u.created_at))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(f"{cell:<{w}}" for cell, w in zip(r, widths, strict=False)) + "  " + r[-1])
    return 0


def revoke(args: argparse.Namespace) -> int:
    try:
        users.revoke(state_dir.resolve(args.state_dir), args.name)
    except users.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"user {args.name!r} revoked: their token is refused from now on; their jobs stay", file=sys.stderr)
    return 0


def _limit(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("token", help="the service's users and their tokens (on the state directory; no server needed)")
    tokens = p.add_subparsers(dest="token_command", required=True)
    s = tokens.add_parser("create", help="add a user; prints their token once")
    s.add_argument("name")
    s.add_argument("--admin", action="store_true", help="sees and controls every user's jobs")
    s.add_argument("--max-cpus", type=float, default=None, metavar="N",
                   help="most CPUs the user's running jobs hold at once (default: no limit)")
    s.add_argument("--max-gpus", type=float, default=None, metavar="M",
                   help="most GPUs the user's running jobs hold at once (default: no limit)")
    s.set_defaults(func=create)
    tokens.add_parser("list", help="the users (never their tokens)").set_defaults(func=list_users)
    s = tokens.add_parser("revoke", help="remove a user: their token is refused from the next request")
    s.add_argument("name")
    s.set_defaults(func=revoke)
