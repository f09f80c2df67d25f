"""One contract for the control API: the plugin's, the twin's and the collector's views agree."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from controlplane.replica_http import StateFormatError, completion_row, read_state
from scheduler import contract
from scheduler.plugin.api import PREFIX
from scheduler.settings import Settings
from tailpilot.cli import main

ROOT = Path(__file__).resolve().parents[1]


def strict(model, doc):
    return contract.read(model, doc, lenient=False)


def check_state_page(doc: dict) -> None:
    """``doc`` is a State a producer may send, every completion a strict Completion with its seq,
    and the collector reads the same values back."""
    strict(contract.State, doc)
    assert doc["completions"], "test needs completions to mean anything"
    for c in doc["completions"]:
        comp = strict(contract.Completion, c)
        assert comp.seq is not None
        row = completion_row("r", c)
        assert (
            row.request_id,
            row.arrival_s,
            row.finished_s,
            row.output_tokens,
            row.max_tokens,
        ) == (comp.id, comp.arrival, comp.finished_at, comp.output_tokens, comp.max_tokens)
    seen = read_state(doc)
    for key in (
        "policy",
        "settings_version",
        "waiting",
        "running",
        "finished_total",
        "next_cursor",
        "more",
        "gamma_live",
        "instance",
        "settings",
    ):
        assert getattr(seen, key) == doc[key], key
    assert seen.kv is not None and seen.kv.model_dump() == doc["kv"]


def test_a_twin_sends_what_the_contract_says():
    from tuner.twins.cluster import start_twins

    with start_twins(
        1, speed=200, settings=Settings.model_validate({"policy": "uniboost"}), token="t"
    ) as cluster:
        url = cluster.replicas[0].url + PREFIX
        with httpx.Client(timeout=10) as http:
            import time

            deadline = time.monotonic() + 30
            while not (doc := http.get(url + "/state", params={"cursor": 0}).json())["completions"]:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            check_state_page(doc)
            strict(contract.SettingsAnswer, http.get(url + "/settings").json())
            put = http.put(
                url + "/settings", json={"policy": "fcfs"}, headers={"Authorization": "Bearer t"}
            )
            assert strict(contract.SettingsAnswer, put.json()).restart_required == []
            steps = http.get(url + "/steps", params={"cursor": 0}).json()
            assert strict(contract.StepsPage, steps).steps
            bad = http.get(url + "/state", params={"cursor": "x"})
            assert bad.status_code == 400 and strict(contract.ErrorAnswer, bad.json()).error
            check_inflight(http.get(url + "/inflight", params={"limit": 3}).json(), 3)
            for limit in ("0", str(contract.INFLIGHT_LIMIT + 1), "x"):
                bad = http.get(url + "/inflight", params={"limit": limit})
                assert bad.status_code == 400 and "limit" in bad.json()["error"]


def check_inflight(doc: dict, limit: int) -> list[dict]:
    """``doc`` is an Inflight a producer may send: at most ``limit`` requests, oldest first, and
    nothing that tells an output length before the request finished."""
    seen = strict(contract.Inflight, doc)
    assert len(seen.requests) <= limit and seen.total >= len(seen.requests)
    assert [(r.arrival, r.id) for r in seen.requests] == sorted(
        (r.arrival, r.id) for r in seen.requests
    )
    for entry in doc["requests"]:
        assert not {"output_tokens", "finished_at"} & set(entry), entry
    return doc["requests"]


@pytest.mark.vllm_in_process
def test_the_plugin_sends_what_the_contract_says():
    pytest.importorskip("vllm")
    from plugin_harness import Driver, make_request, make_scheduler, minimal_model_dir

    from scheduler.plugin.vllm import TailpilotScheduler

    s = make_scheduler(
        TailpilotScheduler,
        model_dir=minimal_model_dir(),
        num_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        settings={"policy": "uniboost"},
    )
    try:
        d = Driver(s)
        d.add(*[make_request(f"r{i}", 16 + i, 4) for i in range(3)])
        listed = check_inflight(s.api_inflight(2), 2)
        assert [r["id"] for r in listed] == ["r0", "r1"] and s.api_inflight(5)["total"] == 3
        d.run()
        after = s.api_inflight(5)
        assert (after["total"], after["requests"]) == (0, [])
        check_state_page(s.api_state(0))
        strict(contract.SettingsAnswer, s.api_settings())
        strict(contract.StepsPage, s.api_steps(0))
    finally:
        s.shutdown()


def test_a_lenient_reader_nulls_a_broken_optional_field_and_names_a_missing_required_one():
    doc = {
        "completions": [],
        "next_cursor": 3,
        "waiting": "many",
        "gamma_live": math.inf,
        "kv": {"used_blocks": True, "total_blocks": 10, "usage": 0.5},
    }
    seen = read_state(doc)
    assert seen.kv is not None
    assert (seen.waiting, seen.gamma_live, seen.kv.used_blocks, seen.kv.total_blocks) == (
        None,
        None,
        None,
        10,
    )
    with pytest.raises(ValidationError):
        strict(contract.State, doc)  # a producer must send it right
    for broken, field in (
        ({"completions": []}, "next_cursor"),
        ({"next_cursor": 1}, "completions"),
        ({"completions": [], "next_cursor": -1}, "next_cursor"),
        ([], "object"),
    ):
        with pytest.raises(StateFormatError, match=field):
            read_state(broken)


def test_a_broken_completion_is_refused_whole():
    good = {"seq": 0, "id": "a", "arrival": 1.0, "finished_at": 2.0, "output_tokens": 3}
    assert completion_row("r", good).output_tokens == 3
    for bad in (
        {**good, "finished_at": math.nan},
        {**good, "output_tokens": "three"},
        {**good, "id": None},
        "x",
    ):
        with pytest.raises(ValueError):
            completion_row("r", bad)


def test_the_published_schema_is_the_contract():
    res = CliRunner().invoke(main, ["schema"])
    assert res.exit_code == 0
    published = (ROOT / "docs" / "control-api.schema.json").read_text(encoding="utf-8")
    assert json.loads(res.output) == json.loads(published), (
        "run: tailpilot schema --out docs/control-api.schema.json"
    )
    docs = json.loads(published)["documents"]
    assert {"state", "completion", "steps", "settings", "error"} <= set(docs)
    assert {"completions", "next_cursor"} <= set(docs["state"]["required"])


def test_a_request_naming_no_tenant_or_type_is_the_engines_default_everywhere():
    """The engine, the simulator and the collector agree on what a request that names neither
    tenant nor type is (the collector used to file it under type "default", the engine "chat")."""
    from scheduler.names import DEFAULT_TENANT, DEFAULT_TYPE
    from scheduler.policies import RequestState
    from sim.traces import TraceRequest

    row = completion_row("r", {"id": "a", "arrival": 1.0, "finished_at": 2.0, "seq": 0})
    engine = RequestState(id="a", arrival=1.0, prompt_tokens=1, max_tokens=1)
    trace = TraceRequest(id="a", arrival=1.0, prompt_tokens=1, output_tokens=1, max_tokens=1)
    assert (row.tenant, row.type) == (engine.tenant, engine.type) == (trace.tenant, trace.type)
    assert (row.tenant, row.type) == (DEFAULT_TENANT, DEFAULT_TYPE) == ("default", "chat")
