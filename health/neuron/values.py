"""Values read out of the Neuron tools' JSON, which may hold anything: a number, an object or a
string when the field is one, else None, {} or ""."""

from __future__ import annotations


def json_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def json_obj(value: object) -> dict[str, object]:
    return value if isinstance(value, dict) else {}


def json_str(value: object) -> str:
    return value.strip() if isinstance(value, str) else ""
