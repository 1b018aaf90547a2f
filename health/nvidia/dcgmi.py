"""``dcgmi diag``'s table (DCGM 3.x and 4.x) and its ``-j`` JSON: a pure parser."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from health.model import Action, Finding, Status, excerpt, probe_failed

_U, _D, _H = Status.UNHEALTHY, Status.DEGRADED, Status.HEALTHY


# dcgmi exits with the dcgmReturn_t as an unsigned byte (dcgm_structs.h; docs/probe-formats.md §2.4).
DCGMI_EXIT_CODES: dict[int, str] = {
    205: "DCGM_ST_NVVS_ISOLATE_ERROR: an error with ISOLATE priority",
    226: "DCGM_ST_NVVS_ERROR: a test reported an error",
    235: "DCGM_ST_CONNECTION_NOT_VALID: nv-hostengine not running?",
    242: "DCGM_ST_NO_DATA",
}
_ISOLATE_EXIT = 205
_DCGM_STATUSES = ("pass", "fail", "warn", "skip", "not run")
_SOFTWARE = frozenset({"deployment", "metadata", "software"})
_PENDING = re.compile(r"pending", re.IGNORECASE)
_REMAP = re.compile(r"remap|retire", re.IGNORECASE)
_INFO_WIDTH = 45  # DATA_INFO_TAG_LEN in dcgmi/Diag.cpp: long messages wrap every 45 characters


@dataclass(slots=True)
class _DiagTest:
    name: str
    category: str
    summary: str = ""  # the test's own status where the tool gives one (4.x row, JSON test_summary)
    statuses: list[str] = field(default_factory=list)  # 3.x aggregated rows, entity-less JSON results
    entities: dict[str, str] = field(default_factory=dict)  # "GPU 0" -> status
    messages: list[str] = field(default_factory=list)  # Warning / Error texts (not Info)

    def worst(self) -> str:
        if self.summary:
            return self.summary
        found = [*self.statuses, *self.entities.values()]
        return next((s for s in ("fail", "warn", "pass", "skip", "not run") if s in found), "")


def check_dcgmi_diag(text: str, returncode: int | None = None) -> list[Finding]:
    """Judge ``dcgmi diag -r N`` output: the text table (DCGM 3.x and 4.x) or ``-j`` JSON, and
    dcgmi's exit code when known. See the module docstring for the rule."""
    probe = "dcgmi-diag"
    body = text.strip()
    parsed: list[_DiagTest] | str
    version = ""
    if not body:
        parsed = "dcgmi printed nothing"
    elif body[0] == "{":
        parsed, version = _diag_json(body)
    else:
        parsed, version = _diag_table(body)
    exit_note = _dcgmi_exit(returncode)
    if isinstance(parsed, str):
        if returncode == _ISOLATE_EXIT:
            return [Finding(probe=probe, status=_U, action=Action.REPLACE,
                            evidence=f"dcgmi exited {exit_note}; the output cannot be read: {parsed}")]
        return [probe_failed(probe, parsed + (f" (exit {exit_note})" if returncode else ""))]

    findings: list[Finding] = []
    ran = [t for t in parsed if t.worst() in ("pass", "fail", "warn")]
    for t in parsed:
        worst = t.worst()
        if worst not in ("fail", "warn"):
            continue
        # 4.x shows a warned entity as "Fail" under a "Warn" test row
        bad = ([e for e, s in t.entities.items() if s == worst]
               or [e for e, s in t.entities.items() if s == "fail"])
        on = f" on {', '.join(bad)}" if bad else ""
        message = "; ".join(m for m in t.messages if m)
        said = f": {excerpt(message)}" if message else ""
        where = f"{t.name} ({t.category})" if t.category else t.name
        if worst == "warn":
            findings.append(Finding(probe=probe, status=_D, evidence=f"{where}: Warn{on}{said}"))
            continue
        soft = t.category.lower() in _SOFTWARE
        pending = bool(_PENDING.search(message) and _REMAP.search(message))
        action = (Action.REPLACE if returncode == _ISOLATE_EXIT
                  else Action.REBOOT if soft or pending else Action.REPLACE)
        findings.append(Finding(probe=probe, status=_U, action=action, evidence=f"{where}: Fail{on}{said}"))
    if any(f.status is _U for f in findings):
        return findings
    if returncode == _ISOLATE_EXIT:
        return [*findings, Finding(probe=probe, status=_U, action=Action.REPLACE,
                                   evidence=f"dcgmi exited {exit_note}, the output shows no failed test")]
    if returncode:
        return [*findings, probe_failed(probe, f"dcgmi exited {exit_note} though no test failed")]
    if not ran:
        return [*findings, probe_failed(probe, f"no test ran ({len(parsed)} skipped or not run)")]
    if findings:
        return findings
    gpus = sorted({e for t in parsed for e in t.entities}, key=_natural)
    on = f" on {len(gpus)} GPUs" if gpus else ""
    ver = f" (DCGM {version})" if version else ""
    return [Finding(probe=probe, status=_H,
                    evidence=f"{len(ran)} tests passed{on}{ver}: {', '.join(t.name for t in ran[:8])}")]


def _dcgmi_exit(returncode: int | None) -> str:
    if returncode is None:
        return "?"
    meaning = DCGMI_EXIT_CODES.get(returncode)
    return f"{returncode} ({meaning})" if meaning else str(returncode)


def _natural(s: str) -> tuple[str, int]:
    m = re.match(r"(\D*)(\d+)", s)
    return (m.group(1), int(m.group(2))) if m else (s, -1)


_SECTION = re.compile(r"^[|+]-+\s+(\w+)\s+-+\+-+[|+]$")
_BORDER = re.compile(r"^\+-+\+-+\+$")
_RESULT = re.compile(r"^(Pass|Fail|Warn|Skip|Not Run)\b\s*(?:-\s*(.*?))?\s*$", re.IGNORECASE)
_ENTITY_RESULT = re.compile(r"^([A-Za-z_]+?)\s*(\d+):\s*(Pass|Fail|Warn|Skip|Not Run)\s*$", re.IGNORECASE)
_MESSAGE_NAME = re.compile(r"^(Warning|Error|Info)\b", re.IGNORECASE)


def _diag_table(body: str) -> tuple[list[_DiagTest] | str, str]:
    lines = [ln.rstrip() for ln in body.splitlines()]
    try:
        start = next(i for i, ln in enumerate(lines) if re.match(r"^\|\s*Diagnostic\s*\|\s*Result\s*\|$", ln))
    except StopIteration:
        errors = [ln.strip() for ln in lines if ln.strip().startswith("Error")]
        first = errors[0] if errors else next((ln for ln in lines if ln.strip()), "")
        return f"no dcgmi diag table: {excerpt(first)!r}", ""
    tests: list[_DiagTest] = []
    category, version = "", ""
    current: _DiagTest | None = None
    fragments: list[str] | None = None  # the Warning/Error/Info row being read, as wrapped
    keep = False  # whether that message goes into the evidence (Info does not)
    closed = False

    def flush() -> None:
        nonlocal fragments
        if current is not None and fragments is not None and keep:
            current.messages.append(_unwrap(fragments))
        fragments = None

    for ln in lines[start + 1:]:
        s = ln.strip()
        if not s:
            continue
        sec = _SECTION.match(s)
        if sec:
            flush()
            category, current = sec.group(1), None
            continue
        if re.match(r"^\+=+\+=+\+$", s):
            continue
        if _BORDER.match(s):
            flush()
            closed = True
            break
        if not (s.startswith("|") and s.endswith("|") and s.count("|") >= 3):
            return f"a line inside the dcgmi table is not a row (truncated?): {excerpt(s)!r}", version
        name_raw, info_raw = s[1:-1].split("|", 1)
        name, info = name_raw.strip(), info_raw.strip()
        value = info_raw[1:] if info_raw.startswith(" ") else info_raw  # the padded 46-wide value
        if not category or category.lower() == "metadata":
            version = info if name == "DCGM Version" else version
            continue
        if name and _MESSAGE_NAME.match(name):
            flush()
            if current is None:
                return f"a {name} row before any test: {excerpt(s)!r}", version
            fragments, keep = [value], not name.lower().startswith("info")
            continue
        if name:
            flush()
            m = _RESULT.match(info)
            if not m:
                return f"test {name!r} has no result: {excerpt(info)!r}", version
            current = _DiagTest(name, category)
            status, rest = m.group(1).lower(), m.group(2)
            if rest is None:
                current.summary = status  # 4.x, and every Deployment row
            else:
                current.statuses.append(status)  # 3.x: "Pass - All", "Fail - GPU: 0"
                _entities(current, status, rest)
            tests.append(current)
            continue
        # a continuation row: a message wrapped at 45 characters, an entity result (4.x:
        # "GPU0: Pass"), or a further aggregated result (3.x: "Fail - GPU: 0")
        if current is None:
            return f"a continuation row before any test: {excerpt(s)!r}", version
        ent, agg = _ENTITY_RESULT.match(info), _RESULT.match(info)
        if ent:
            flush()
            current.entities[f"{ent.group(1).upper()} {ent.group(2)}"] = ent.group(3).lower()
        elif fragments is not None:
            fragments.append(value)
        elif agg:
            current.statuses.append(agg.group(1).lower())
            _entities(current, agg.group(1).lower(), agg.group(2) or "")
        else:
            return f"an unreadable row under {current.name!r}: {excerpt(s)!r}", version
    if not closed:
        return "the dcgmi table is not closed by its border (truncated?)", version
    if not tests:
        return "the dcgmi table lists no test", version
    return tests, version


def _unwrap(fragments: list[str]) -> str:
    """Re-join a message dcgmi cut every 45 characters: a fragment keeps its 45th character even
    when that is a space; a shorter one (another layout) is taken as ending at a word."""
    text = "".join(f[:_INFO_WIDTH] if len(f) > _INFO_WIDTH else f.rstrip() + " " for f in fragments[:-1])
    return " ".join((text + fragments[-1]).split())


def _entities(test: _DiagTest, status: str, rest: str) -> None:
    """3.x aggregated results: ``Pass - All``, ``Fail - GPU: 0``, ``Pass - GPUs: 1, 2``."""
    m = re.match(r"GPUs?:\s*(.*)$", rest.strip())
    if m:
        for gid in re.findall(r"\d+", m.group(1)):
            test.entities[f"GPU {gid}"] = status


def _diag_json(body: str) -> tuple[list[_DiagTest] | str, str]:
    try:
        doc: object = json.loads(body)
    except ValueError as e:
        return f"dcgmi JSON does not parse (truncated?): {e}", ""
    roots = list(_diag_roots(doc))
    error = _find_key(doc, "runtime_error")
    if error:
        return f"dcgmi could not run the diagnostic: {excerpt(str(error))}", ""
    if not roots:
        keys = ", ".join(list(doc)[:6]) if isinstance(doc, dict) else type(doc).__name__
        return f"not dcgmi diag JSON (no test_categories; top level: {keys})", ""
    tests: list[_DiagTest] = []
    version = ""
    for root in roots:
        version = version or str(root.get("version", ""))
        cats = root.get("test_categories")
        if not isinstance(cats, list):
            return "test_categories is not a list", version
        for cat in cats:
            if not isinstance(cat, dict) or not isinstance(cat.get("tests"), list):
                return "a test category without a list of tests", version
            cname = str(cat.get("category", ""))
            for t in cat["tests"]:
                if not isinstance(t, dict) or not isinstance(t.get("results"), list):
                    return f"a test in {cname or '?'} without results", version
                test = _DiagTest(str(t.get("name", "?")), cname)
                summary = t.get("test_summary")
                if isinstance(summary, dict) and isinstance(summary.get("status"), str):
                    test.summary = summary["status"].strip().lower()
                    if test.summary not in _DCGM_STATUSES:
                        return f"{test.name}: unknown test_summary status {summary['status']!r}", version
                for r in t["results"]:
                    if not isinstance(r, dict) or not isinstance(r.get("status"), str):
                        return f"a result of {test.name} without a status", version
                    status = r["status"].strip().lower()
                    if status not in _DCGM_STATUSES:
                        return f"{test.name}: unknown status {r['status']!r}", version
                    warnings = _json_warnings(r.get("warnings"))
                    if status == "pass" and warnings:
                        status = "warn"  # a pass that says something: worth a look
                    entity = _json_entity(r)
                    if entity:
                        test.entities[entity] = status
                    else:
                        test.statuses.append(status)
                    test.messages += warnings
                tests.append(test)
    if not tests:
        return "dcgmi JSON lists no test", version
    return tests, version


def _diag_roots(doc: object) -> list[dict[str, object]]:
    """Every object holding ``test_categories`` (one per iteration with ``--iterations``)."""
    out: list[dict[str, object]] = []
    if isinstance(doc, dict):
        if "test_categories" in doc:
            out.append(doc)
        else:
            for v in doc.values():
                out += _diag_roots(v)
    elif isinstance(doc, list):
        for v in doc:
            out += _diag_roots(v)
    return out


def _find_key(doc: object, key: str) -> object:
    if isinstance(doc, dict):
        if doc.get(key):
            return doc[key]
        for v in doc.values():
            found = _find_key(v, key)
            if found:
                return found
    return None


def _json_entity(r: dict[str, object]) -> str:
    group = str(r.get("entity_group", "GPU") or "GPU").upper()
    for key in ("entity_id", "gpu_id", "gpu_ids"):
        value = r.get(key)
        if value is not None and str(value).strip():
            return f"{group} {str(value).strip()}"
    return ""


def _json_warnings(value: object) -> list[str]:
    """``warnings``: a string (2.x), a list of strings, or of objects with ``warning`` (or, in
    3.x deployment results, ``warnings``)."""
    if isinstance(value, str):
        return [excerpt(value)] if value.strip() else []
    out = []
    if isinstance(value, list):
        for item in value:
            w = (item.get("warning") or item.get("warnings") or "") if isinstance(item, dict) else item
            if isinstance(w, str) and w.strip():
                out.append(excerpt(w))
    return out
