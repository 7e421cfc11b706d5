"""`trainyard token create|update|list|revoke`: the service's users, their data roots and limits, made on the state
directory (no server needed; a running service sees the change from its next request). See `service.tenancy.users`."""

from __future__ import annotations

import argparse
import sys
import time

from trainyard.service import state_dir
from trainyard.service.tenancy import users


def create(args: argparse.Namespace) -> int:
    try:
        token = users.create(state_dir.resolve(args.state_dir), args.name, admin=args.admin, limits=_limits(args))
    except users.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # The token alone on stdout (TOKEN=$(trainyard token create NAME)); the notice where a terminal shows it.
    print(f"user {args.name!r}{' (admin)' if args.admin else ''}: their token, shown this once (only its hash is "
          "kept); give it to them as TRAINYARD_TOKEN or --token:", file=sys.stderr)
    print(token)
    return 0


def update(args: argparse.Namespace) -> int:
    try:
        user = users.update(state_dir.resolve(args.state_dir), args.name, _limits(args))
    except users.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"user {user.name!r} updated: {_describe(user)}", file=sys.stderr)
    return 0


def _limits(args: argparse.Namespace) -> users.Limits:
    return users.Limits(max_cpus=args.max_cpus, max_gpus=args.max_gpus,
                        data_roots=tuple(args.data_root) if args.data_root else None, max_queued=args.max_queued,
                        max_priority=args.max_priority, max_storage_bytes=args.max_storage,
                        unset=tuple(name.replace("-", "_") for name in getattr(args, "unset", None) or ()))


def _describe(u: users.User) -> str:
    return (f"max_cpus {_limit(u.max_cpus)}, max_gpus {_limit(u.max_gpus)}, max_queued {_limit(u.max_queued)}, "
            f"max_priority {_limit(u.max_priority)}, max_storage {_limit(u.max_storage_bytes)}, data roots "
            f"{', '.join(u.data_roots) or '-'}")


def list_users(args: argparse.Namespace) -> int:
    rows = [("NAME", "ROLE", "MAX_CPUS", "MAX_GPUS", "MAX_QUEUED", "MAX_PRIORITY", "MAX_STORAGE", "CREATED",
             "DATA_ROOTS"),
            (users.ADMIN, "admin", "-", "-", "-", "-", "-", "-", "(the state directory's token: reads any path but "
                                                               "the state directory)")]
    for u in users.read(state_dir.resolve(args.state_dir)):
        rows.append((u.name, "admin" if u.admin else "user", _limit(u.max_cpus), _limit(u.max_gpus),
                     _limit(u.max_queued), _limit(u.max_priority), _limit(u.max_storage_bytes),
                     time.strftime("%Y-%m-%d %H:%M", time.localtime(u.created_at)),
                     ", ".join(u.data_roots) or ("(any path)" if u.admin else "-")))
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
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def parse_size(text: str) -> int:
    """A size in bytes: a number, or one with K, M, G or T (powers of 1024)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    number, unit = (text[:-1], units[text[-1].upper()]) if text and text[-1].upper() in units else (text, 1)
    try:
        value = int(float(number) * unit)
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 500M, 16G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive")
    return value


def _limit_options(s: argparse.ArgumentParser, default_note: str) -> None:
    s.add_argument("--max-cpus", type=float, default=None, metavar="N",
                   help=f"most CPUs the user's running jobs hold at once; a rank counts at least 1 ({default_note})")
    s.add_argument("--max-gpus", type=float, default=None, metavar="M",
                   help=f"most GPUs the user's running jobs hold at once ({default_note})")
    s.add_argument("--data-root", action="append", metavar="DIR",
                   help="a directory the user's jobs may read data and models under (repeat for more; their uploads "
                        f"and jobs' outputs they read always) ({default_note})")
    s.add_argument("--max-queued", type=int, default=None, metavar="N",
                   help=f"most of the user's jobs waiting in the queue at once ({default_note})")
    s.add_argument("--max-priority", type=int, default=None, metavar="N",
                   help="highest priority the user's jobs may ask for (default 0; an admin's: any)")
    s.add_argument("--max-storage", type=parse_size, default=None, metavar="SIZE",
                   help=f"most bytes of uploads, checkpoints and models the user's files hold, e.g. 50G "
                        f"({default_note})")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("token", help="the service's users and their tokens (on the state directory; no server needed)")
    tokens = p.add_subparsers(dest="token_command", required=True)
    s = tokens.add_parser("create", help="add a user; prints their token once")
    s.add_argument("name")
    s.add_argument("--admin", action="store_true", help="sees and controls every user's jobs; reads any path")
    _limit_options(s, "default: no limit")
    s.set_defaults(func=create)
    s = tokens.add_parser("update", help="change a user's limits and data roots (their token stays)")
    s.add_argument("name")
    _limit_options(s, "default: unchanged; --data-root replaces them all")
    s.add_argument("--unset", action="append", metavar="LIMIT",
                   choices=["max-cpus", "max-gpus", "data-roots", "max-queued", "max-priority", "max-storage-bytes"],
                   help="remove a limit (max-priority: any priority), or every data root")
    s.set_defaults(func=update)
    tokens.add_parser("list", help="the users (never their tokens)").set_defaults(func=list_users)
    s = tokens.add_parser("revoke", help="remove a user: their token is refused from the next request")
    s.add_argument("name")
    s.set_defaults(func=revoke)
