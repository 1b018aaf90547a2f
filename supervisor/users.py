"""Who a run's trainers execute as, and the checks that keep them from running as root.

A run executes as one user: the spec's ``user``, else the daemon config's ``run_as``,
else the user the daemon runs as (``training-supervisor run``: whoever invoked it). The
daemon switches to that user when it starts the trainer's processes (the local
launcher's ranks, Slurm's ``sbatch`` and ``srun``), which only a daemon running as root
can do; a daemon running as a dedicated user starts runs as that user only. Either way:

- ``serve`` refuses a run that would execute as root unless its config sets
  ``allow_root_runs``: the reference trainer loads pickles (DCP metadata) from its
  checkpoint directory, and a user's trainer is whatever its script does;
- a spec's ``user`` must be a person's account (``may_run_as``: uid from UID_MIN, a
  login shell, not an administrator: no member of sudo, wheel, admin or docker, not a
  cloud image's default account such as ubuntu or ec2-user) or one the config's
  ``run_users`` lists: whoever holds the API's write token must not run code as munge,
  slurm, or as someone who is root on every node by a word to sudo or docker;
- a run's checkpoint directory must be writable by the run's user (checked at submit,
  from the mode bits of the directory or of its nearest existing parent), so that a
  spec cannot point a run at a directory it could not save in, or at one of root's;
- the run directory, the attempt directories and the checkpoint directory the daemon
  creates are handed to the run's user (``hand_over``).
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from supervisor import user_files
from supervisor.errors import CannotExecute, SpecError


@dataclass(frozen=True, slots=True)
class RunAs:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # every group the user is in, the primary one included
    home: str

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    @property
    def is_me(self) -> bool:
        """The daemon's own user: nothing to switch."""
        return self.uid == os.geteuid()



# What of the daemon's own environment a process it starts (a job's rank, a node
# wrapper, srun, a probe) inherits: the locale and the paths a node's software needs, the
# accelerators' and libraries' own settings, Slurm's and this project's. Not the rest: a
# systemd unit's NOTIFY_SOCKET, CREDENTIALS_DIRECTORY or INVOCATION_ID, an operator's
# SSH_AUTH_SOCK or SUDO_* or cloud credentials are nothing a user's job may have. A job
# that needs more sets it in its spec's ``env``.
INHERITED_NAMES = frozenset({
    "PATH", "LANG", "LANGUAGE", "TZ", "TMPDIR", "HOME", "USER", "LOGNAME", "SHELL", "LD_LIBRARY_PATH",
    "VIRTUAL_ENV", "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE",
})
INHERITED_PREFIXES = ("LC_", "TSUP_", "SLURM_", "CUDA_", "NCCL_", "NEURON_", "FI_", "XLA_", "TORCH",
                      "OMP_", "MKL_", "GLOO_", "NVIDIA_", "MALLOC_")


def inherited_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The part of ``environ`` (the daemon's own, by default) a process it starts gets."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k in INHERITED_NAMES or k.startswith(INHERITED_PREFIXES)}


def login_env(user: RunAs | None) -> dict[str, str]:
    """HOME, USER and LOGNAME of ``user`` for a process started as it (empty: as the daemon)."""
    if user is None or user.is_me:
        return {}
    return {"HOME": user.home, "USER": user.name, "LOGNAME": user.name}


def popen_ids(user: RunAs | None) -> tuple[int | None, int | None, list[int] | None]:
    """``subprocess.Popen``'s (user, group, extra_groups) that start a process as ``user``
    (all None: as the daemon itself)."""
    if user is None or user.is_me:
        return None, None, None
    return user.uid, user.gid, list(user.groups)


def lookup(name: str) -> RunAs:
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise SpecError(f"user: no user {name!r} on this host") from None
    groups = {pw.pw_gid, *(g.gr_gid for g in grp.getgrall() if name in g.gr_mem)}
    return RunAs(name=name, uid=pw.pw_uid, gid=pw.pw_gid, groups=tuple(sorted(groups)), home=pw.pw_dir)


def for_launch(name: str | None) -> RunAs | None:
    """The user a launch starts processes as (None: the daemon's own); CannotExecute when
    that user is gone from this host since the run was submitted."""
    if name is None:
        return None
    try:
        return lookup(name)
    except SpecError as e:
        raise CannotExecute(f"cannot start the trainer as {name}: {e}") from None


def daemon_user() -> RunAs:
    return lookup(pwd.getpwuid(os.geteuid()).pw_name)


def resolve(spec_user: str | None, run_as: str | None, *, allow_root: bool,
            run_users: Sequence[str] | None = None, admin_rights: bool = False) -> RunAs:
    """The user a run executes as; SpecError naming the key when it cannot or must not.
    ``run_users``: the config's allow-list for a spec's ``user`` (None: ``may_run_as``).
    ``admin_rights``: the daemon's own user may drain nodes (``slurm_admin_prefix``), so a
    run must not execute as it (its trainer would inherit them) unless the config says so
    (``runs_share_admin_rights``, for a cluster of one tenant)."""
    key = "user" if spec_user else "run_as (config)" if run_as else None
    name = spec_user or run_as
    user = lookup(name) if name else daemon_user()
    if user.is_root and not allow_root:
        where = (f"{key} names root" if key else
                 "the daemon runs as root and neither the spec (user) nor the config (run_as) names a user")
        raise SpecError(f"user: this run would execute as root ({where}); name another user, or set "
                        "allow_root_runs = true in the daemon's config")
    if admin_rights and user.is_me:
        raise SpecError(f"user: this run would execute as {user.name}, the daemon's own user, which may "
                        "drain and resume nodes (slurm_admin_prefix): its trainer would inherit that. Run "
                        "the daemon as root with runs as their users, or set runs_share_admin_rights = true "
                        "in the daemon's config on a cluster of one tenant")
    # The operator's own choices (run_as, the daemon's user) stand; a spec's is checked.
    if spec_user and not user.is_root and spec_user != run_as and not user.is_me:
        refused = may_run_as(user, run_users)
        if refused:
            raise SpecError(f"user: a run may not execute as {user.name}: {refused}")
    me = daemon_user()
    if not user.is_me and not me.is_root:
        raise SpecError(f"{key or 'user'}: this daemon runs as {me.name} and can start trainers as "
                        f"{me.name} only, not as {user.name} (that needs a daemon running as root)")
    return user


def uid_min(login_defs: Path = Path("/etc/login.defs")) -> int:
    """The first uid of a person's account (UID_MIN of login.defs; 1000 where unset)."""
    try:
        for line in login_defs.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 2 and fields[0] == "UID_MIN" and fields[1].isdigit():
                return int(fields[1])
    except OSError:
        pass
    return 1000


_NO_LOGIN = ("/usr/sbin/nologin", "/sbin/nologin", "/bin/false", "/usr/bin/false")
# Groups whose members are root on the node by a word (sudo, docker's socket), and the
# cloud images' default accounts (passwordless sudo on every AMI that has them).
ADMIN_GROUPS = ("sudo", "wheel", "admin", "adm", "docker", "lxd")
ADMIN_ACCOUNTS = ("ubuntu", "ec2-user", "centos", "rocky", "admin", "debian", "fedora", "cloud-user")


def may_run_as(user: RunAs, run_users: Sequence[str] | None) -> str:
    """Why a spec may not name ``user`` ("" when it may). With the config's ``run_users``,
    only the accounts it lists; without it, a person's account: a uid from UID_MIN on (not
    ``nobody``) with a login shell. Service accounts (munge, which reads the key that
    signs every Slurm credential; slurm; daemons) are never a run's user by default."""
    if run_users is not None:
        return "" if user.name in run_users else "it is not in run_users (the daemon's config)"
    first = uid_min()
    if user.uid < first or user.uid >= 65534:
        return (f"uid {user.uid} is a service account's (below UID_MIN {first}, or nobody); list it "
                "in run_users in the daemon's config if it is meant to run training")
    shell = pwd.getpwnam(user.name).pw_shell
    if shell in _NO_LOGIN:
        return (f"its shell is {shell} (a service account); list it in run_users if it is meant to "
                "run training")
    if user.name in ADMIN_ACCOUNTS:
        return (f"{user.name} is a cloud image's administrator account (root on the node by sudo); "
                "list it in run_users if it is meant to run training")
    admin = sorted(g for g in _group_names(user.groups) if g in ADMIN_GROUPS)
    if admin:
        return (f"it is in {', '.join(admin)} (root on the node by a word to sudo or docker); list it in "
                "run_users if it is meant to run training")
    return ""


def _group_names(gids: Sequence[int]) -> list[str]:
    names = []
    for gid in gids:
        try:
            names.append(grp.getgrgid(gid).gr_name)
        except KeyError:
            continue
    return names


def writable_by(path: Path, user: RunAs) -> bool:
    """Whether ``user`` may create files in ``path`` (or, while it does not exist, in its
    nearest existing parent, where it would be made), by the mode bits (ACLs not read)."""
    if user.is_root:
        return True
    here = _nearest_existing(path)
    if here is None:
        return False
    for part in [*reversed(here.parents), here]:  # every directory on the way must be searchable
        if not _may(part.stat(), user, stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH):
            return False
    st = here.stat()
    return stat.S_ISDIR(st.st_mode) and _may(st, user, stat.S_IWUSR, stat.S_IWGRP, stat.S_IWOTH)


def daemon_may_write(path: Path) -> bool:
    """Whether this process may create files in ``path`` (or in its nearest existing
    parent): its own rights, and a file system it may write (a systemd unit's
    ProtectSystem=strict leaves only its ReadWritePaths writable, and access(2) says so)."""
    here = _nearest_existing(path)
    return here is not None and here.is_dir() and os.access(here, os.W_OK | os.X_OK)


def _nearest_existing(path: Path) -> Path | None:
    """``path``, or its nearest parent that exists (where ``path`` would be made)."""
    here = path
    while not here.exists():
        if here.parent == here:
            return None
        here = here.parent
    return here


def _may(st: os.stat_result, user: RunAs, u: int, g: int, o: int) -> bool:
    if st.st_uid == user.uid:
        return bool(st.st_mode & u)
    if st.st_gid in user.groups:
        return bool(st.st_mode & g)
    return bool(st.st_mode & o)


def hand_over(user: RunAs, base: Path, *paths: Path) -> None:
    """Make each directory (created if missing) and file under ``base`` (a directory of the
    daemon's) the run's user's: its trainers write there. Only a root daemon starting
    another user's run changes anything, and never through a link the user planted
    (``user_files.hand_over``)."""
    if user.is_me:
        return
    user_files.hand_over(base, user, *paths)
