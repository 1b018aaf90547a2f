"""People: a token per person, bound to a Unix account, and what each may do through the API.

An operator issues a person's token on the controller (``training-supervisor token issue
alice``, as root): the daemon keeps its SHA-256 in SQLite (``people``), and the token
itself goes to the person's own ``~/.config/training-supervisor/token``, mode 0600,
written as that person (``write_token_file``), where ``supervisorctl`` finds it, and
refuses it when others may read it. Issuing again replaces the old token; ``token
revoke`` removes it.

Who may do what (``Caller``):

    the daemon's API token   an operator: every run and node, every write
    the read-only token      every read, no write (dashboards, Prometheus, the page)
    a person's token         their own runs: read them (logs included), submit (as
                             themselves), cancel, pause, resume, restart; list the nodes.
                             Another's run is 403, as is /metrics and every node command.
    an operator's token      (issued with --operator) all of the above on every run and
                             node, as the API token, and submit as any run user

A run is its user's: the account it executes as (the spec's ``user``, or the daemon's
``run_as``). A person's submission without a ``user`` executes as that person.
"""

from __future__ import annotations

import hashlib
import secrets
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from supervisor import users
from supervisor.errors import Forbidden

TOKEN_PATH = Path(".config") / "training-supervisor" / "token"  # in the person's home
_TOKEN_BYTES = 32


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent an API request, from its token."""

    user: str | None  # a person's account; None: one of the daemon's own tokens
    operator: bool  # every run and node
    writes: bool  # False: the read-only token

    def name(self) -> str:
        return self.user or ("the API token" if self.writes else "the read-only token")


ADMIN = Caller(user=None, operator=True, writes=True)
READER = Caller(user=None, operator=True, writes=False)


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token() -> str:
    return secrets.token_urlsafe(_TOKEN_BYTES)


def may_see(caller: Caller, run_id: str, owner: str | None) -> None:
    """Forbidden unless ``caller`` may read ``run_id`` (whose runs execute as ``owner``)."""
    if not caller.operator and caller.user != owner:
        raise Forbidden(f"{run_id} is {owner or 'the daemon user'}'s: {caller.name()} may read and act on "
                        "its own runs only")


def operators_only(caller: Caller, what: str) -> None:
    if not caller.operator:
        raise Forbidden(f"{what} is for operators: {caller.name()}'s token is a person's")


def submitter(caller: Caller, spec_user: str | None) -> str | None:
    """The user a run ``caller`` submits executes as (None: the daemon's rule, ``run_as``)."""
    if caller.user is None or (caller.operator and spec_user is not None):
        return spec_user
    if spec_user is not None and spec_user != caller.user:
        raise Forbidden(f"the spec names user {spec_user!r}: {caller.user}'s token submits runs as "
                        f"{caller.user} only")
    return caller.user


# As the person: their home is theirs, and so is whatever a link there points to.
_WRITE_AS_USER = r"""
import os, sys
path = sys.argv[1]
os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
tmp = path + ".new"
fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
with os.fdopen(fd, "w") as f:
    f.write(sys.stdin.read())
    f.flush()
    os.fsync(f.fileno())
os.chmod(tmp, 0o600)
os.replace(tmp, path)
"""


def write_token_file(user: str, token: str) -> Path:
    """``token`` into ``user``'s ~/.config/training-supervisor/token (0600), written as
    ``user``; OSError naming the file when it cannot be."""
    person = users.lookup(user)
    path = Path(person.home) / TOKEN_PATH
    uid, gid, groups = users.popen_ids(person)  # as root: the person; as the person: itself
    done = subprocess.run([sys.executable, "-c", _WRITE_AS_USER, str(path)], input=token + "\n", text=True,
                          capture_output=True, user=uid, group=gid, extra_groups=groups, timeout=30,
                          check=False, env={"PATH": "/usr/bin:/bin", **users.login_env(person)}, cwd="/")
    if done.returncode != 0:
        why = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        raise OSError(f"cannot write {path} as {user}: {why}")
    return path
