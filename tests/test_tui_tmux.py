"""``tailpilot demo`` in a real terminal: started under tmux, driven with keys, read back with
capture-pane."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

TMUX = shutil.which("tmux")
assert TMUX, "tmux is not installed (scripts/test.sh installs it)"


def demo_command() -> list[str]:
    exe = shutil.which("tailpilot") or os.path.join(os.path.dirname(sys.executable), "tailpilot")
    assert os.path.exists(exe), "the tailpilot command is not installed (pip install -e .)"
    return [exe, "demo"]


class Tmux:
    def __init__(self) -> None:
        self.socket = f"tailpilot-test-{uuid.uuid4().hex[:8]}"
        self.session = "demo"
        self.path = ""

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            [TMUX, "-L", self.socket, *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=30,
        )

    def start(self, command: list[str], cwd: str, width: int = 160, height: int = 48) -> None:
        env_cmd = " ".join(f"'{c}'" for c in command)
        self.run(
            "new-session",
            "-d",
            "-s",
            self.session,
            "-x",
            str(width),
            "-y",
            str(height),
            "-c",
            cwd,
            f"env -u COLUMNS -u LINES TERM=xterm-256color {env_cmd}",
        )  # the pane's size, not pytest's
        self.path = self.run(
            "display-message", "-p", "-t", self.session, "#{socket_path}"
        ).stdout.strip()

    def alive(self) -> bool:
        return self.run("has-session", "-t", self.session, check=False).returncode == 0

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", self.session).stdout

    def keys(self, *keys: str) -> None:
        self.run("send-keys", "-t", self.session, *keys)

    def wait_for(self, predicate, timeout: float = 60.0, what: str = "") -> str:
        end = time.monotonic() + timeout
        text = ""
        while time.monotonic() < end:
            if not self.alive():
                raise AssertionError(
                    f"the demo exited while waiting for {what}; last screen:\n{text}"
                )
            text = self.screen()
            if predicate(text):
                return text
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}; screen:\n{text}")

    def kill(self) -> None:
        self.run("kill-server", check=False)
        if self.path and os.path.basename(self.path) == self.socket:  # tmux leaves its socket file
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def showing(*texts: str):
    """A screen predicate: every one of ``texts`` is on it."""
    return lambda screen: all(t in screen for t in texts)


@pytest.fixture
def tmux():
    t = Tmux()
    yield t
    t.kill()


@pytest.mark.slow
def test_demo_under_tmux_keys_and_screens(tmux, tmp_path):
    cmd = [
        *demo_command(),
        "--replicas",
        "3",
        "--speed",
        "10",
        "--policy",
        "uniboost",
        "--db",
        str(tmp_path / "demo.db"),
    ]
    tmux.start(cmd, str(tmp_path))  # the demo may write its cluster file to the working directory
    # The cluster screen with every twin polled and healthy.
    # A screen is drawn in pieces: each wait is for everything it must show, not for its first
    # line (a capture between two pieces is a partial screen, not a wrong one).
    tmux.wait_for(
        showing(
            *(f"twin-{i}" for i in range(3)), "3/3 healthy", "TTLT p50/p95/p99", "uniboost", "LIVE"
        ),
        timeout=90,
        what="the cluster screen",
    )
    # ? opens the help generated from the key table.
    tmux.keys("?")
    tmux.wait_for(
        showing("tailpilot — keys", "Switch the policy of the targets", "Step back one sample"),
        what="help",
    )
    tmux.keys("Escape")
    tmux.wait_for(lambda s: "tailpilot — keys" not in s, what="help closed")
    # 2: the replica screen of the cursor replica, with its plots and tenant table.
    tmux.keys("2")
    tmux.wait_for(
        showing("panel replica", "TTFT (s)", "twin-0", "per tenant", "live γ"),
        what="replica screen",
    )
    # P (capital: a cluster change) asks which policy, and Escape sends nothing.
    tmux.keys("1")
    tmux.wait_for(lambda s: "panel cluster" in s, what="cluster screen again")
    tmux.keys("P")
    tmux.wait_for(lambda s: "Switch policy of twin-0" in s, what="policy picker")
    tmux.keys("Escape")
    tmux.wait_for(lambda s: "Switch policy of twin-0" not in s, what="picker closed")
    # q quits: the process ends (and takes its twins with it).
    tmux.keys("q")
    end = time.monotonic() + 30
    while tmux.alive() and time.monotonic() < end:
        time.sleep(0.2)
    assert not tmux.alive(), "q did not quit the demo"
    assert (tmp_path / "demo.db").exists()  # the demo's collector wrote its store
