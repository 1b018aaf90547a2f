"""The daemon's log lines: human text, or one JSON object per line (``log_format``).

journald stores each line of stderr as one entry; a JSON line keeps the fields apart
for whatever reads the journal next (``journalctl -o cat | jq``). Fields: ``ts`` (Unix
seconds), ``level``, ``logger``, ``message``, ``exc`` when an exception is attached, and
any ``extra={...}`` the call passed.

Trainer text (an exit reason, a log line, a fault's detail) reaches these lines and the
operator's terminal (supervisorctl). In text form every control character in it is
escaped (``printable``): a newline cannot forge a line of its own, an escape sequence
cannot rewrite the operator's screen.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any

_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


# Control characters (C0, DEL, C1), and the format characters that reorder or hide text
# on a terminal: bidi overrides and isolates, zero-width ones, line and paragraph separators.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e"
                      r"\u2060-\u206f\ufeff\ufff9-\ufffb]")


def printable(text: str) -> str:
    """``text`` with each control or format character as a Python escape: ``\\n``,
    ``\\x1b``, ``\\u202e``."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


def printable_tree(value: Any) -> Any:
    """Every string in a JSON value made ``printable`` (keys too)."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, list):
        return [printable_tree(v) for v in value]
    if isinstance(value, dict):
        return {printable(k) if isinstance(k, str) else k: printable_tree(v) for k, v in value.items()}
    return value


class TextFormatter(logging.Formatter):
    """The text form: the message's control characters escaped (a traceback keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                                  "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
        return json.dumps(doc, separators=(",", ":"))


def configure(log_format: str, level: int) -> None:
    """Send the process's logs to stderr in ``log_format`` (text or json), replacing any
    handler set before."""
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
