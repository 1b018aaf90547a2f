"""supervisor/ports.py: a port chosen below the kernel's ephemeral range, where no
outgoing connection can take it before its listener binds it."""

from __future__ import annotations

import random
import socket

import pytest

from supervisor import ports


def test_the_ephemeral_range_is_read_and_a_bad_one_is_linuxs_default() -> None:
    assert ports.ephemeral_range("32768\t60999\n") == (32768, 60999)
    assert ports.ephemeral_range("1024 65535") == (1024, 65535)
    assert ports.ephemeral_range("garbage") == (32768, 60999)


def test_the_port_is_below_the_ephemeral_range_and_free() -> None:
    low, _ = ports.ephemeral_range()
    for _ in range(20):
        port = ports.free_port()
        assert 10000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: binding it works


def test_a_port_already_listened_on_is_not_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (busy + 1, 60999))
        monkeypatch.setattr(ports, "_LOWEST", busy)  # the only candidate is the busy port
        port = ports.free_port(rng=random.Random(1))
        assert port != busy  # every try hit the listener: the kernel's choice instead


def test_with_no_room_below_the_range_the_kernel_chooses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    port = ports.free_port()
    assert 1024 <= port <= 65535
