"""The test-port chooser: below the kernel's ephemeral range, one block per xdist worker, never a
port something listens on."""

from __future__ import annotations

import socket

import net_support
import pytest


def test_ports_come_from_this_workers_block_below_the_ephemeral_range(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    ports = net_support.worker_ports()
    seen = {next(ports) for _ in range(net_support.BLOCK_PORTS)}
    first = net_support.FIRST_BLOCK_PORT + net_support.BLOCK_PORTS
    assert seen == set(range(first, first + net_support.BLOCK_PORTS))  # the whole block, once
    assert max(seen) < net_support.ephemeral_low()


def test_workers_get_disjoint_blocks(monkeypatch):
    blocks = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        ports = net_support.worker_ports()
        blocks.append({next(ports) for _ in range(net_support.BLOCK_PORTS)})
    assert sum(len(block) for block in blocks) == len(set().union(*blocks))


def test_a_port_something_listens_on_is_passed_over(monkeypatch):
    with socket.socket() as released:
        released.bind(("127.0.0.1", 0))
        candidate = released.getsockname()[1]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(net_support, "PORTS", iter([busy, busy, candidate]))
        assert net_support.free_port() == candidate
        monkeypatch.setattr(net_support, "PORTS", iter([busy] * 3))
        with pytest.raises(StopIteration):  # only taken ports left: never one of them
            net_support.free_port()
