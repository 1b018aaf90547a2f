"""Where supervisorctl finds the daemon and its token: flags, then the environment, then
its config file (the order cli/ctl.py's docstring gives)."""

from __future__ import annotations

import argparse
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cli.client import DEFAULT_URL
from supervisor.config import default_state_dir
from supervisor.token_file import READ_TOKEN_FILE_NAME, TOKEN_FILE_NAME, read_token

SYSTEM_TOKEN_FILE = Path("/var/lib/training-supervisor") / TOKEN_FILE_NAME
SYSTEM_READ_TOKEN_FILE = SYSTEM_TOKEN_FILE.with_name(READ_TOKEN_FILE_NAME)


class UsageError(Exception):
    """Bad input found before asking the daemon: exit 2."""



def daemon_settings(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, Any]:
    """The daemon's URL and how to authenticate, from flags, environment and config."""
    explicit = getattr(args, "config", None) or env.get("TSUP_CTL_CONFIG")
    path = Path(explicit) if explicit else config_home(env) / "training-supervisor" / "supervisorctl.toml"
    config = read_config(path, explicit=bool(explicit))
    url = getattr(args, "url", None) or env.get("TSUP_URL") or config.get("url") or DEFAULT_URL
    ca_file = env.get("TSUP_CA_FILE") or config.get("ca_file")
    token, hint = token_of(args, env, config)
    return {"url": url, "token": token, "token_hint": hint, "verify": ca_file or True}


def config_home(env: Mapping[str, str]) -> Path:
    return Path(env.get("XDG_CONFIG_HOME") or Path(env.get("HOME") or Path.home()) / ".config")


def read_config(path: Path, *, explicit: bool) -> dict[str, str]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        if explicit:
            raise UsageError(f"{path}: no such config file") from None
        return {}
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot read: {e}") from e
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{path}: not valid TOML: {e}") from e
    known = {"url", "token_file", "ca_file"}
    for key, value in data.items():
        if key not in known:
            raise UsageError(f"{path}: {key}: unknown key (known: {', '.join(sorted(known))})")
        if not isinstance(value, str):
            raise UsageError(f"{path}: {key}: expected a string")
    return data


def token_of(args: argparse.Namespace, env: Mapping[str, str],
           config: Mapping[str, str]) -> tuple[str | None, str]:
    """The token (None: none found) and where it was looked for."""
    explicit = getattr(args, "token_file", None) or env.get("TSUP_API_TOKEN_FILE") or config.get("token_file")
    if env.get("TSUP_API_TOKEN"):
        return env["TSUP_API_TOKEN"].strip(), "$TSUP_API_TOKEN"
    if explicit:
        try:
            return read_token(Path(explicit)), str(explicit)
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot use the API token file {explicit}: {e}") from e
    # A person's own (training-supervisor token issue): refused, not used, when others may read it.
    own = config_home(env) / "training-supervisor" / "token"
    try:
        return read_token(own, check_mode=True, what="personal API token"), str(own)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot use your token file: {e}") from e
    # An operator's own: the API token; a watcher's: the read-only one.
    candidates = [SYSTEM_TOKEN_FILE, default_state_dir() / TOKEN_FILE_NAME,
                  SYSTEM_READ_TOKEN_FILE, default_state_dir() / READ_TOKEN_FILE_NAME]
    for candidate in candidates:
        try:
            return read_token(candidate), str(candidate)
        except (OSError, ValueError):
            continue
    return None, " or ".join(str(c) for c in candidates)
