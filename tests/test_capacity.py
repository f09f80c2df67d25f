"""``tailpilot capacity`` (tuner/closed_loop/capacity.py): the smallest replica count that keeps the
mean per-window SCR at target, found by simulation; the KV bound; the command."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner

from scheduler.settings import Settings, SloFqParams
from sim.engine import EngineConfig
from sim.noisy import capacity as measured_capacity
from sim.noisy import noisy_neighbour
from tuner.closed_loop.capacity import capacity, evaluate, split


@pytest.fixture(scope="module")
def overload():
    """Three steady tenants at 3x one replica's capacity together (no burst), 60 s."""
    cap = measured_capacity(EngineConfig(), Settings(), n=600)
    return noisy_neighbour(capacity_req_s=cap, share=1.0, burst=1.0, duration_s=60.0)


def test_split_deals_every_request_once_in_arrival_order(overload):
    trace, _ = overload
    parts = split(trace, 3)
    ids = [r.id for p in parts for r in p]
    assert sorted(ids) == sorted(r.id for r in trace) and len(ids) == len(set(ids))
    assert all([r.arrival for r in p] == sorted(r.arrival for r in p) for p in parts)


def test_the_smallest_count_that_meets_the_target(overload):
    trace, params = overload
    slo = SloFqParams.model_validate(params)
    settings = Settings.model_validate({"policy": "slofq", "params": params})
    plan = capacity(
        trace, slo, settings, EngineConfig(), target=0.99, window_s=10.0, max_replicas=16
    )
    n = plan["replicas"]
    assert n is not None and n >= 3  # three replicas' worth of traffic
    rows = {r["replicas"]: r for r in plan["rows"]}
    assert rows[n]["scr_mean"] >= 0.99 and rows[n]["lost"] == 0
    assert rows[n - 1]["scr_mean"] < 0.99  # bisection tried the count below
    assert rows[1]["scr_mean"] < rows[n]["scr_mean"]


@pytest.mark.slow
def test_the_kv_bound_says_when_memory_not_the_scheduler_binds(overload):
    trace, params = overload
    slo = SloFqParams.model_validate(params)
    settings = Settings.model_validate({"policy": "slofq", "params": params})
    roomy = evaluate(trace, 4, slo, settings, EngineConfig(), window_s=10.0, target=0.99)
    assert not roomy["kv_bound"] and roomy["kv_demand_tokens"] > 0
    tight = evaluate(
        trace, 1, slo, settings, EngineConfig(num_gpu_blocks=300), window_s=10.0, target=0.99
    )
    assert tight["kv_bound"] and tight["kv_demand_tokens"] > tight["kv_capacity_tokens"] == 300 * 16


def test_the_command(tmp_path):
    """On the bundled window at 4x its rate, with one default tenant and its SLOs from the cluster
    file: more than one replica, the answer's SCR at target; no governance block is a usage
    error."""
    from tailpilot.cli import main

    cluster = {
        "clusters": [
            {
                "name": "c",
                "governance": {"default_tenant": {"ttft": {"p50": 0.5, "p99": 2.0}}},
                "replicas": [
                    {
                        "name": "r",
                        "api_url": "http://127.0.0.1:1",
                        "control_url": "http://127.0.0.1:2",
                    }
                ],
            }
        ]
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cluster))
    args = [
        "capacity",
        "--cluster",
        str(tmp_path / "c.yaml"),
        "--from",
        "0",
        "--to",
        "120",
        "--rate-scale",
        "4",
        "--window-s",
        "20",
        "--max-replicas",
        "16",
    ]
    res = CliRunner().invoke(main, [*args, "--json"])
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    rows = {r["replicas"]: r for r in plan["rows"]}
    assert (
        plan["replicas"] > 1
        and plan["policy"] == "slofq"
        and rows[plan["replicas"]]["scr_mean"] >= 0.99
    )
    text = CliRunner().invoke(main, args).output
    assert f"{plan['replicas']} replicas keep the mean per-window SCR at 0.99" in text
    cluster["clusters"][0].pop("governance")
    (tmp_path / "bare.yaml").write_text(yaml.safe_dump(cluster))
    res = CliRunner().invoke(main, ["capacity", "--cluster", str(tmp_path / "bare.yaml")])
    assert res.exit_code == 2 and "no governance block" in res.output
