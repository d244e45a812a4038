"""runtime.ports.free_port: a port a later process can bind, outside the ephemeral range."""

from __future__ import annotations

import socket

from gspo_megatron.runtime import ports


def _bind(port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", port))
    return s


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    lo, hi = ports.ephemeral_range()
    assert 0 < lo <= hi < 65536
    seen = set()
    for _ in range(20):
        port = ports.free_port()
        assert 10000 <= port < lo  # never where outgoing connections take their local ports
        _bind(port).close()
        seen.add(port)
    assert len(seen) > 1  # chosen at random, so two launchers rarely pick the same one


def test_free_port_skips_a_bound_port(monkeypatch):
    taken = _bind(0)
    try:
        busy = taken.getsockname()[1]
        picks = iter([busy, busy, busy + 1 if busy + 1 < 65536 else busy - 1])
        monkeypatch.setattr(ports.random.SystemRandom, "randrange", lambda self, a, b: next(picks))
        monkeypatch.setattr(ports, "ephemeral_range", lambda: (65000, 65535))
        assert ports.free_port() != busy
    finally:
        taken.close()


def test_free_port_falls_back_to_the_kernel_when_no_room_below(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (10500, 65535))
    port = ports.free_port()
    assert port > 0
    _bind(port).close()
