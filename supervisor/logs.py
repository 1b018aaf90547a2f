"""The daemon's log lines: human text, or one JSON object per line (``log_format``).

journald stores each line of stderr as one entry; a JSON line keeps the fields apart
for whatever reads the journal next (``journalctl -o cat | jq``). Fields: ``ts`` (Unix
seconds), ``level``, ``logger``, ``message``, ``exc`` when an exception is attached, and
any ``extra={...}`` the call passed.
"""

from __future__ import annotations

import json
import logging
import sys

_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


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
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
