"""Ports for servers started later: out of the kernel's way, and free."""

import socket
from pathlib import Path

import pytest

from tunekit.runtime import dist as tk_dist


def test_free_port_is_bindable_and_below_the_ephemeral_range():
    ports = {tk_dist.free_port() for _ in range(20)}
    low = tk_dist._ephemeral_low()
    if low is not None:
        assert all(1024 <= p < low for p in ports)
    assert len(ports) > 1  # random, not one fixed port a second caller would also get
    port = ports.pop()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_without_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(tk_dist, "_ephemeral_low", lambda: None)
    assert tk_dist.free_port() > 0


@pytest.mark.skipif(
    not Path("/proc/sys/net/ipv4/ip_local_port_range").exists(), reason="Linux only"
)
def test_a_taken_port_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        held.listen()
        assert not tk_dist._bindable(taken)
