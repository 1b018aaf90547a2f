"""`training-supervisor token`: people's API tokens (supervisor/people.py), as root on the
controller, beside the daemon (its store is SQLite: this writes while it runs).

    training-supervisor token issue USER [--operator] [--config FILE | --state-dir DIR] [--json]
    training-supervisor token revoke USER [...]
    training-supervisor token list [...]

``issue`` makes a new token for the Unix account USER, replacing any earlier one: the
daemon keeps its SHA-256, and the token goes to USER's ~/.config/training-supervisor/token
(mode 0600, written as USER), where ``supervisorctl`` finds it. ``--operator``: the token
acts on every run and node, as the daemon's API token does.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from supervisor import people, users
from supervisor.config import default_state_dir, load_service_config
from supervisor.domain import Person
from supervisor.errors import NotFound, SupervisorError
from supervisor.store import SqlStore


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    token = sub.add_parser("token", help="people's API tokens: issue, revoke, list (as root)",
                           description=__doc__.split("\n\n")[0])
    verbs = token.add_subparsers(dest="verb", required=True)
    for verb, helped in (("issue", "make USER a token of their own (replacing an earlier one)"),
                         ("revoke", "take USER's token away"), ("list", "who holds a token")):
        p = verbs.add_parser(verb, help=helped)
        if verb != "list":
            p.add_argument("user", help="a Unix account on this host")
        if verb == "issue":
            p.add_argument("--operator", action="store_true",
                           help="the token acts on every run and node (default: the person's own runs)")
        p.add_argument("--config", type=Path, default=None, metavar="FILE",
                       help="the daemon's config, for its state_dir (default: TSUP_CONFIG)")
        p.add_argument("--state-dir", type=Path, default=None, help="the daemon's state directory")
        p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    listed: list[Person] = []
    store = SqlStore(_state_dir(args) / "supervisor.db")
    store.open()
    try:
        if args.verb == "issue":
            out = _issue(store, args.user, args.operator)
        elif args.verb == "revoke":
            with store.tx() as tx:
                if not tx.remove_person(args.user):
                    raise NotFound(f"{args.user} holds no token")
            out = {"user": args.user, "revoked": True}
        else:
            with store.tx() as tx:
                listed = tx.list_people()
            out = {"people": [{"user": p.user, "operator": p.operator, "issued_at": p.issued_at}
                              for p in listed]}
    finally:
        store.close()
    if args.json:
        print(json.dumps(out))
    elif args.verb == "issue":
        role = "an operator's token" if out["operator"] else "a token for their own runs"
        print(f"{out['user']}: {role}, in {out['token_file']} (supervisorctl reads it there)")
    elif args.verb == "revoke":
        print(f"{args.user}: token revoked")
    else:
        for p in listed:
            print(f"{p.user:<16} {'operator' if p.operator else 'own runs'}  issued "
                  f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(p.issued_at))}")
    return 0


def _issue(store: SqlStore, user: str, operator: bool) -> dict[str, object]:
    account = users.lookup(user)  # SpecError: no such user
    if account.is_root:
        raise SupervisorError("root holds the daemon's own API token; a person's token is for a person")
    token = people.new_token()
    try:  # first: a token nobody holds is never made valid
        path = people.write_token_file(user, token)
    except OSError as e:
        raise SupervisorError(str(e)) from e
    with store.tx() as tx:
        tx.set_person(Person(user=user, operator=operator, issued_at=time.time()), people.token_hash(token))
    return {"user": user, "operator": operator, "token_file": str(path)}


def _state_dir(args: argparse.Namespace) -> Path:
    if args.state_dir is not None:
        return Path(args.state_dir)
    path = args.config or (Path(os.environ["TSUP_CONFIG"]) if os.environ.get("TSUP_CONFIG") else None)
    config = load_service_config(path, os.environ)
    return config.state_dir or default_state_dir()
