"""The embedded broker's accounts and limits without a network (supervisor/telemetry/access.py);
tests/integration/test_broker_security.py attacks the real broker."""

from __future__ import annotations

import asyncio

import pytest

import wire as p
from supervisor.telemetry.access import (
    MAX_LOGIN_CHARS,
    MAX_PACKET_BYTES,
    REFUSAL_WINDOW_S,
    REFUSALS_LOGGED,
    BrokerAccess,
    covers,
)
from supervisor.telemetry.broker import PacketLimit, PacketTooLarge
from trainer.telemetry_env import broker_from_env

SECRET = b"the supervisor's secret"
ACCESS = BrokerAccess("c1", SECRET, "sup-pass", reader_password="read-pass")


@pytest.mark.parametrize(("allowed", "wanted", "expected"), [
    ("tsup/v1/c1/telemetry/#", "tsup/v1/c1/telemetry/run-1/1/0/step", True),
    ("tsup/v1/c1/telemetry/#", "tsup/v1/c1/telemetry/#", True),
    ("tsup/v1/c1/telemetry/#", "tsup/v1/c1/telemetry/+/1/#", True),
    ("tsup/v1/c1/telemetry/#", "tsup/v1/#", False),
    ("tsup/v1/c1/telemetry/#", "#", False),
    ("tsup/v1/c1/telemetry/#", "tsup/v1/+/telemetry/x", False),
    ("tsup/v1/c1/telemetry/run-1/1/+/+", "tsup/v1/c1/telemetry/run-1/1/3/lost", True),
    ("tsup/v1/c1/telemetry/run-1/1/+/+", "tsup/v1/c1/telemetry/run-1/1/3/lost/x", False),
    ("tsup/v1/c1/telemetry/run-1/1/+/+", "tsup/v1/c1/telemetry/run-1/1/3", False),
    ("tsup/v1/c1/telemetry/run-1/1/+/+", "tsup/v1/c1/telemetry/run-1/12/3/lost", False),
    ("tsup/v1/c1/telemetry/run-1/1/+/+", "tsup/v1/c1/telemetry/run-1/1/#", False),
    ("tsup/v1/c1/supervisor", "tsup/v1/c1/supervisor", True),
    ("tsup/v1/c1/supervisor", "tsup/v1/c1/+", False),
])
def test_a_filter_covers_only_what_it_matches(allowed: str, wanted: str, expected: bool) -> None:
    assert covers(allowed, wanted) is expected


def test_each_login_opens_its_own_account_and_a_wrong_one_none() -> None:
    user, password = p.attempt_login(SECRET, "c1", "run-1", 2)
    assert user == "c1/run-1/2" and password != p.attempt_key(SECRET, "c1", "run-1", 2).hex()
    rank = ACCESS.account(user, password)
    assert rank is not None
    assert rank.may_publish("tsup/v1/c1/telemetry/run-1/2/0/step")
    assert not rank.may_publish("tsup/v1/c1/telemetry/run-1/1/0/step")
    assert not rank.may_publish("tsup/v1/c1/events/run-1") and not rank.may_publish(p.presence_topic("c1"))
    assert rank.may_subscribe(p.presence_topic("c1")) and not rank.may_subscribe("tsup/v1/c1/events/#")
    assert not rank.may_retain("tsup/v1/c1/telemetry/run-1/2/0/step")
    supervisor = ACCESS.account("supervisor", "sup-pass")
    assert supervisor is not None and supervisor.max_packet is None
    assert supervisor.may_retain(p.presence_topic("c1")) and supervisor.may_subscribe(p.topic_filter("c1"))
    assert not supervisor.may_publish("tsup/v1/c1/telemetry/run-1/2/0/step")
    reader = ACCESS.account("reader", "read-pass")
    assert reader is not None and reader.may_subscribe("tsup/v1/c1/events/#") and not reader.publish
    wrong: list[tuple[str | None, str | None]] = [
        (user, password[:-1] + "0"), ("c2/run-1/2", password), ("supervisor", "x"), ("reader", "sup-pass"),
        ("supervisor", None), (None, None), ("", ""), ("c1/run-1/0", password), ("c1/run/1/2", password),
        ("supervisor", "pässword")]
    for login in wrong:
        assert ACCESS.account(*login) is None, login
    assert BrokerAccess("c1", SECRET, "sup-pass").account("reader", "") is None, "no reader without its token"


@pytest.mark.parametrize(("run", "attempt", "rank", "pid"), [("run-1", 1, 0, 99), ("run-1-1", 12, 3, 4),
                                                              ("a.b_c", 7, 0, 1)])
def test_a_client_id_names_one_attempt_only(run: str, attempt: int, rank: int, pid: int) -> None:
    assert p.attempt_of_client_id(p.client_id(run, attempt, rank, pid)) == (run, attempt)


@pytest.mark.parametrize("value", ["tsup-1-0-9", "tsup--1-0-9", "training-supervisor-c-1", "tsup-r/x-1-0-9",
                                   "tsup-run-1-x-0-9", "run-1-1-0-9", "tsup-run-1-1-0-٣"])
def test_what_is_not_a_ranks_client_id(value: str) -> None:
    assert p.attempt_of_client_id(value) is None


def test_a_connect_is_refused_unless_login_client_id_session_and_will_are_the_accounts() -> None:
    user, password = p.attempt_login(SECRET, "c1", "run-1", 1)
    rank = ACCESS.account(user, password)
    own_id, will = p.client_id("run-1", 1, 0, 9), ("tsup/v1/c1/telemetry/run-1/1/0/lost", False)

    def why(account: object, **changes: object) -> str | None:
        asked = {"client_id": own_id, "clean_session": True, "will": will, "holder": None, **changes}
        return ACCESS.refusal(account, **asked)  # type: ignore[arg-type]

    assert why(rank) is None and why(rank, holder=user) is None, "its own reconnect takes its session back"
    assert "no such login" in (why(None) or "")
    assert "not one of" in (why(rank, client_id=p.client_id("run-1", 2, 0, 9)) or "")
    assert "another account's" in (why(ACCESS.account("reader", "read-pass"), client_id="dash", holder=user) or "")
    assert "persistent" in (why(rank, clean_session=False) or "")
    assert "may not publish" in (why(rank, will=("tsup/v1/c1/telemetry/run-1/2/0/lost", False)) or "")
    assert "may not retain" in (why(rank, will=(will[0], True)) or "")
    assert "not one of" in (why(ACCESS.account("reader", "read-pass"), client_id=own_id) or "")
    assert "not one of" in (why(ACCESS.account("reader", "read-pass"), client_id="training-supervisor-x") or "")


def _packet(kind: int, body: bytes) -> bytes:
    length, n = b"", len(body)
    while True:
        byte, n = n & 0x7F, n >> 7
        length += bytes([byte | (0x80 if n else 0)])
        if not n:
            return bytes([kind << 4]) + length + body


def test_a_packet_over_the_limit_ends_the_stream_at_its_header() -> None:
    async def read_all(data: bytes, limit: int | None, step: int) -> int:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        stream, got = PacketLimit(reader, limit), 0
        while got < len(data):
            got += len(await stream.read(min(step, len(data) - got)))
        return got

    fine = _packet(12, b"") + _packet(3, b"x" * 1000) + _packet(14, b"") + _packet(3, b"y" * MAX_PACKET_BYTES)
    for step in (1, 7, 4096):
        assert asyncio.run(read_all(fine, MAX_PACKET_BYTES, step)) == len(fine)
    huge = _packet(12, b"") + _packet(3, b"z" * (MAX_PACKET_BYTES + 1))
    with pytest.raises(PacketTooLarge, match="at most"):
        asyncio.run(read_all(huge, MAX_PACKET_BYTES, 1))
    assert asyncio.run(read_all(huge, None, 4096)) == len(huge), "no limit: the supervisor's own"
    with pytest.raises(PacketTooLarge, match="4 bytes"):
        asyncio.run(read_all(bytes([0x30, 0xFF, 0xFF, 0xFF, 0xFF, 0x01]), None, 1))


def test_a_ranks_login_comes_from_its_environment_over_the_urls() -> None:
    env = {"TSUP_MQTT_URL": "mqtt://10.0.0.5:1883", p.USERNAME_ENV: "c1/run-1/1", p.PASSWORD_ENV: "pw"}
    broker = broker_from_env(env)
    assert broker is not None and (broker.url.username, broker.url.password) == ("c1/run-1/1", "pw")
    assert "pw" not in str(broker.url)
    broker = broker_from_env({"TSUP_MQTT_URL": "mqtts://site:site-pw@b:8883"})
    assert broker is not None and (broker.url.username, broker.url.password) == ("site", "site-pw")


def test_fences_are_the_supervisors_to_retain_and_each_attempts_own_to_read() -> None:
    """The supervisor fences an ended attempt (retained); that attempt's agents read it;
    no account but the supervisor's writes one, and an attempt reads no other's."""
    supervisor = ACCESS.account("supervisor", "sup-pass")
    assert supervisor is not None
    fence = p.fence_topic("c1", "run-1", 2)
    assert supervisor.may_publish(fence) and supervisor.may_retain(fence)
    rank = ACCESS.account(*p.attempt_login(SECRET, "c1", "run-1", 2))
    assert rank is not None
    assert rank.may_subscribe(fence) and not rank.may_publish(fence)
    assert not rank.may_subscribe(p.fence_topic("c1", "run-1", 3)) and not rank.may_subscribe(p.fence_filter("c1"))
    assert p.attempt_of_client_id(p.client_id("run-1", 2, "n0", 4242)) == ("run-1", 2), "its agent's id is its own"


def test_only_logins_that_open_an_account_are_remembered_and_an_overlong_one_is_not_checked() -> None:
    """H6 of issue 37: every refused login used to be kept (3,000 of 60 KB grew the daemon by
    517 MiB); now a guess costs one check and nothing kept."""
    access = BrokerAccess("c1", SECRET, "sup-pass", reader_password="read-pass")
    for i in range(1000):
        assert access.account(f"c1/run-{i}/1", "x" * 200) is None
    assert access.account("supervisor", "s" * (MAX_LOGIN_CHARS + 1)) is None
    assert access.account("u" * (MAX_LOGIN_CHARS + 1), "sup-pass") is None
    assert access._logins == {}
    assert access.account("supervisor", "sup-pass") is not None and len(access._logins) == 1


def test_an_ended_attempts_login_opens_nothing_and_one_the_store_has_not_live_is_refused() -> None:
    live = {("run-1", 2)}
    access = BrokerAccess("c1", SECRET, "sup-pass", is_live=lambda run, n: (run, n) in live)
    user, password = p.attempt_login(SECRET, "c1", "run-1", 2)
    rank = access.account(user, password)
    assert rank is not None and access.refusal(rank, client_id=p.client_id("run-1", 2, 0, 7), clean_session=True,
                                              will=None, holder=None) is None
    old_user, old_password = p.attempt_login(SECRET, "c1", "run-1", 1)  # ended before a restart
    old = access.account(old_user, old_password)
    assert access.refusal(old, client_id=p.client_id("run-1", 1, 0, 7), clean_session=True, will=None,
                          holder=None) == "an attempt that is not live"
    access.end_attempt("run-1", 2)
    assert access.account(user, password) is None, "its login opens nothing once it ended"


def test_refusals_are_logged_a_few_per_address_and_window_then_counted() -> None:
    access = BrokerAccess("c1", SECRET, "sup-pass")
    said = [access.refused("10.0.0.9", 100.0 + i * 0.01) for i in range(REFUSALS_LOGGED + 30)]
    assert [logged for logged, _ in said] == [True] * REFUSALS_LOGGED + [False] * 30
    assert access.refused("10.0.0.8", 101.0) == (True, 0), "another address has its own lines"
    assert access.refused("10.0.0.9", 100.0 + REFUSAL_WINDOW_S + 1) == (True, 30), "the next window says how many"
