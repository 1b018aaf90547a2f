"""A stranger on the network who floods the broker with CONNECTs it cannot log in with.

    python -m tests.fake_tools.login_flood HOST PORT COUNT LOGIN_CHARS

Each CONNECT comes on a connection of its own, with a username and a password of
LOGIN_CHARS characters each, all different. It reads what the broker answers (a CONNACK,
or the connection closed) and prints one JSON line: how many it sent, how many were
refused with CONNACK 5 (not authorized), how many closed without one, and the seconds
it took. Raw sockets, so that nothing on this side limits what is sent.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import time


def _string(b: bytes) -> bytes:
    return struct.pack("!H", len(b)) + b


def _length(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def connect_packet(client_id: str, username: str, password: str) -> bytes:
    """An MQTT 3.1.1 CONNECT: clean session, a username and a password."""
    body = (_string(b"MQTT") + bytes([4, 0xC2]) + struct.pack("!H", 60)
            + _string(client_id.encode()) + _string(username.encode()) + _string(password.encode()))
    return b"\x10" + _length(len(body)) + body


def main(argv: list[str]) -> int:
    host, port, count, chars = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    refused = closed = 0
    began = time.monotonic()
    for i in range(count):
        tag = f"{i:08d}"
        packet = connect_packet(f"flood-{tag}", (tag + "u" * chars)[:chars], (tag + "p" * chars)[:chars])
        with socket.create_connection((host, port), timeout=10) as s:
            try:
                s.sendall(packet)
                answer = s.recv(4)
            except OSError:  # reset while sending: the broker stopped reading at the header
                answer = b""
        if answer[:1] == b"\x20" and len(answer) >= 4 and answer[3] == 5:
            refused += 1
        else:
            closed += 1
    print(json.dumps({"sent": count, "refused": refused, "closed": closed,
                      "seconds": round(time.monotonic() - began, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
