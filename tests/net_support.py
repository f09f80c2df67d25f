"""Ports for the servers tests start (vLLM, control API, PostgreSQL, metrics).

A port picked by binding port 0 comes from the kernel's ephemeral range, the same range every
other process draws from: between choosing it and the server binding it, a vLLM engine starting in
the other xdist worker (its own torch-distributed and ZMQ ports are bound to port 0 too) may take
it, and the server dies with "Address already in use" (a fresh-clone CI run lost a real-engine
fixture that way). So test ports come from below the ephemeral range, one block per xdist worker,
handed out in order within a session: no bind(0) and no other worker of this session can be given
the same port.
"""

from __future__ import annotations

import itertools
import os
import random
import socket
from collections.abc import Iterator
from pathlib import Path

BLOCK_PORTS = 1500
FIRST_BLOCK_PORT = 10_000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_low() -> int:
    """The lowest port the kernel hands out for bind(0) (32768 when it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def worker_index() -> int:
    """This xdist worker's number (``gw3`` → 3); 0 outside xdist."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    digits = name.removeprefix("gw")
    return int(digits) if digits.isdigit() else 0


def worker_ports() -> Iterator[int]:
    """This worker's block, from a random start (two test sessions on one machine rarely meet),
    round and round."""
    blocks = max(1, (ephemeral_low() - FIRST_BLOCK_PORT) // BLOCK_PORTS)
    first = FIRST_BLOCK_PORT + (worker_index() % blocks) * BLOCK_PORTS
    start = random.Random(os.getpid()).randrange(BLOCK_PORTS)
    for offset in itertools.count(start):
        yield first + offset % BLOCK_PORTS


PORTS = worker_ports()


def free_port(host: str = "127.0.0.1") -> int:
    """The next port of this worker's block that nothing listens on now."""
    for _ in range(BLOCK_PORTS):
        port = next(PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in this worker's block of {BLOCK_PORTS}")
