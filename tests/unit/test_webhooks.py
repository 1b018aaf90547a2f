"""The webhooks' rules (supervisor/webhooks.py): which notices a webhook wants, what it
sends, and a config refused with words that never repeat its URL."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from supervisor.config import load_service_config
from supervisor.domain import EventRecord
from supervisor.errors import SpecError, SupervisorError
from supervisor.webhooks import DEFAULT_KINDS, Webhook, body_of, notice_of


def event(kind: str, run_number: int | None = 42, **data: object) -> EventRecord:
    return EventRecord(id=7, run_number=run_number, ts=100.0, kind=kind, message="RUNNING -> FAILED: x", data=data)


def test_a_runs_change_of_state_is_the_notice_of_its_new_state_and_filters_match_notices() -> None:
    failed, recovered = event("run.state", to="FAILED"), event("run.state", to="RUNNING")
    assert notice_of(failed) == "run.failed" and notice_of(event("node.drained")) == "node.drained"
    hook = Webhook(name="ops", url="https://hooks.example/x")
    assert hook.kinds == DEFAULT_KINDS and hook.wants(failed) and not hook.wants(recovered)
    everything_of_nodes = Webhook(name="n", url="https://hooks.example/x", kinds=("node.*",))
    assert everything_of_nodes.wants(event("node.returned")) and not everything_of_nodes.wants(failed)
    one_run = Webhook(name="r", url="https://hooks.example/x", runs=("run-42",))
    assert one_run.wants(failed) and not one_run.wants(event("run.state", 43, to="FAILED"))
    assert not one_run.wants(event("node.drained", None)), "a daemon's own event is no run's"


def test_the_json_form_is_the_event_and_the_slack_form_one_line_of_text() -> None:
    failed = event("run.state", to="FAILED")
    json_form = body_of(Webhook(name="j", url="https://h.example/"), failed, "trn-west")
    assert json_form == {"cluster": "trn-west", "id": 7, "ts": 100.0, "notice": "run.failed", "kind": "run.state",
                         "run_id": "run-42", "message": "RUNNING -> FAILED: x", "data": {"to": "FAILED"}}
    slack = body_of(Webhook(name="s", url="https://h.example/", format="slack"), failed, "trn-west")
    assert slack == {"text": "[trn-west] run-42: run.failed: RUNNING -> FAILED: x"}


def test_a_bad_webhook_is_refused_naming_what_is_wrong_never_the_url(tmp_path: Path) -> None:
    secret = "https://hooks.slack.example/services/T0/B0/XXXXSECRET"
    with pytest.raises(ValidationError, match="give url or url_file"):
        Webhook(name="both", url=secret, url_file=tmp_path / "f")
    with pytest.raises(ValidationError, match="match no notice") as typo:
        Webhook(name="typo", url=secret, kinds=("run.faild",))
    assert "XXXXSECRET" not in str(typo.value)
    (tmp_path / "url").write_text("gopher://x/XXXXSECRET\n")
    with pytest.raises(SupervisorError, match="must be http:// or https://") as bad_file:
        Webhook(name="f", url_file=tmp_path / "url").target()
    assert "XXXXSECRET" not in str(bad_file.value)
    config = tmp_path / "config.toml"
    config.write_text(f'[[notify]]\nname = "a"\nurl = "{secret}"\n[[notify]]\nname = "a"\nurl = "{secret}"\n')
    with pytest.raises(SpecError, match="two \\[\\[notify\\]\\] tables with one name") as twice:
        load_service_config(config, {})
    assert "XXXXSECRET" not in str(twice.value)
