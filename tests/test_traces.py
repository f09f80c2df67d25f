"""Tests for sim.traces: loaders on small fixtures, error reporting, transforms, arrival processes.

Expected values are computed from the fixture files independently of the loader (csv/json/Decimal)
so a parsing bug cannot be mirrored into the expectation.
"""

from __future__ import annotations

import csv
import json
import math
from collections import Counter
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim import traces as T
from sim.traces import Trace, TraceError, TraceRequest

FIXTURES = Path(__file__).parent / "fixtures" / "traces"
AZURE = FIXTURES / "azure_conv_head.csv"
VIDUR = FIXTURES / "vidur_conv_head.csv"
VIDUR_TENANTS = FIXTURES / "vidur_tenants.csv"
LENGTHS = FIXTURES / "sharegpt_lengths_head.csv"
MOONCAKE = FIXTURES / "mooncake_head.jsonl"
BURSTGPT = FIXTURES / "burstgpt_sample.csv"
SERVEGEN = FIXTURES / "servegen_r1_pmf_small.csv"

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _azure_seconds(ts: str) -> Fraction:
    """Exact seconds since the epoch day of an Azure timestamp, via Decimal (independent of the
    loader)."""
    date, clock = ts.split(" ")
    y, mo, d = (int(x) for x in date.split("-"))
    hh, mm, ss = clock.split(":")
    import datetime

    day = datetime.date(y, mo, d).toordinal()
    return Fraction(day * 86400 + int(hh) * 3600 + int(mm) * 60) + Fraction(Decimal(ss))


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text, newline="")
    return p


def _trace(arrivals, prompt=100, output=50, name="t") -> Trace:
    return Trace(
        name,
        tuple(
            TraceRequest(f"r-{i:06d}", float(a), prompt, output, T.DEFAULT_MAX_TOKENS)
            for i, a in enumerate(arrivals)
        ),
    )


# ------------------------------------------------------------------------------------------
# Azure
# ------------------------------------------------------------------------------------------


def test_azure_fixture_exact_values():
    rows = _csv_rows(AZURE)
    trace = T.load_azure(AZURE)
    assert len(trace) == len(rows)
    t0 = _azure_seconds(rows[0]["TIMESTAMP"])
    for req, row in zip(trace, rows):
        exact = _azure_seconds(row["TIMESTAMP"]) - t0
        # Exact to 100 ns, and the arrival is the correctly rounded float of the exact offset.
        assert abs(req.arrival - float(exact)) < 1e-7
        assert req.arrival == float(exact)
        assert req.prompt_tokens == int(row["ContextTokens"])
        assert req.output_tokens == int(row["GeneratedTokens"])
        # Azure records no cap: the fixed default, never the output length.
        assert req.max_tokens == T.DEFAULT_MAX_TOKENS and not req.truncated
        assert (req.tenant, req.type) == ("default", "chat")
    assert trace.requests[0].arrival == 0.0
    assert [r.id for r in trace] == [f"azure_conv_head-{i:06d}" for i in range(len(rows))]
    assert trace.skipped == 0


def test_azure_fractional_seconds_to_100ns(tmp_path):
    text = (
        f"{AZURE_HEADER}\r\n"
        "2023-11-16 23:59:59.9999999,10,5\r\n"
        "2023-11-17 00:00:00.0000001,11,6\r\n"
        "2023-11-17 00:00:01.25,12,7\r\n"
        "2023-11-17 00:00:02,13,8"
    )  # no trailing newline, fewer fractional digits
    trace = T.load_azure(_write(tmp_path, "a.csv", text))
    assert [r.arrival for r in trace] == [
        0.0,
        2e-7,
        float(Fraction(12500001, 10**7)),
        float(Fraction(20000001, 10**7)),
    ]
    assert [r.prompt_tokens for r in trace] == [10, 11, 12, 13]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**7 * 86400 * 3), min_size=1, max_size=20))
def test_azure_timestamps_roundtrip_exactly(tmp_path_factory, offsets):
    """Property: any 100-ns tick offsets written as Azure timestamps come back as exact offsets."""
    import datetime

    base = datetime.datetime(2023, 11, 16, 18, 15, 46)
    ticks = sorted(offsets)
    lines = [AZURE_HEADER]
    for t in ticks:
        stamp = base + datetime.timedelta(seconds=t // 10**7)
        lines.append(f"{stamp:%Y-%m-%d %H:%M:%S}.{t % 10**7:07d},5,5")
    path = tmp_path_factory.mktemp("rt") / "t.csv"
    path.write_text("\r\n".join(lines) + "\r\n")
    trace = T.load_azure(path)
    assert [r.arrival for r in trace] == [float(Fraction(t - ticks[0], 10**7)) for t in ticks]


@pytest.mark.parametrize(
    ("bad_row", "column"),
    [
        ("2023-11-16 18:15:5x.0000000,10,5", "TIMESTAMP"),
        ("2023-11-16 25:15:50.0000000,10,5", "TIMESTAMP"),
        ("2023-02-30 18:15:50.0000000,10,5", "TIMESTAMP"),
        ("2023-11-16 18:15:47.0000000,-3,5", "ContextTokens"),
        ("2023-11-16 18:15:47.0000000,10,0", "GeneratedTokens"),
        ("2023-11-16 18:15:47.0000000,10,2.5", "GeneratedTokens"),
        ("2023-11-16 18:15:47.0000000,ten,5", "ContextTokens"),
        ("2023-11-16 18:15:47.0000000,10,", "GeneratedTokens"),
        ("2023-11-16 18:15:47.0000000,10", "GeneratedTokens"),
        ("2023-11-16 18:15:45.0000000,10,5", "TIMESTAMP"),  # earlier than line 3: goes backwards
    ],
)
def test_azure_malformed_row_names_file_line_and_column(tmp_path, bad_row, column):
    text = (
        f"{AZURE_HEADER}\r\n"
        "2023-11-16 18:15:46.0000000,1,1\r\n"
        "2023-11-16 18:15:46.5000000,2,2\r\n"
        f"{bad_row}\r\n"
        "2023-11-16 18:15:48.0000000,3,3\r\n"
    )
    path = _write(tmp_path, "bad.csv", text)
    with pytest.raises(TraceError) as info:
        T.load_azure(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}:4:"), msg
    assert repr(column) in msg


def test_azure_equal_timestamps_are_not_backwards(tmp_path):
    text = f"{AZURE_HEADER}\n2023-11-16 18:15:46.0,1,1\n2023-11-16 18:15:46.0,2,2\n"
    trace = T.load_azure(_write(tmp_path, "eq.csv", text))
    assert [r.arrival for r in trace] == [0.0, 0.0]
    assert [r.prompt_tokens for r in trace] == [1, 2]  # id order keeps file order on ties


def test_missing_column_is_named(tmp_path):
    path = _write(tmp_path, "nocol.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.0,1\n")
    with pytest.raises(TraceError, match=r":1: missing column 'GeneratedTokens'") as info:
        T.load_azure(path)
    assert str(info.value).startswith(str(path))


def test_missing_file_is_named(tmp_path):
    path = tmp_path / "nope.csv"
    for loader in (T.load_azure, T.load_vidur, T.load_mooncake, T.load_burstgpt, T.load_trace):
        with pytest.raises(TraceError, match=r"nope\.csv"):
            loader(path)
    with pytest.raises(TraceError, match=r"nope\.csv"):
        T.load_lengths(path, rate=1.0)


def test_blank_lines_are_not_requests(tmp_path):
    text = f"{AZURE_HEADER}\n2023-11-16 18:15:46.0,1,1\n\n2023-11-16 18:15:47.0,2,2\n\n"
    assert len(T.load_azure(_write(tmp_path, "blank.csv", text))) == 2


# ------------------------------------------------------------------------------------------
# vidur
# ------------------------------------------------------------------------------------------


def test_vidur_fixture_matches_azure_rows():
    rows = _csv_rows(VIDUR)
    trace = T.load_vidur(VIDUR)
    assert [r.arrival for r in trace] == [float(r["arrived_at"]) for r in rows]
    assert [(r.prompt_tokens, r.output_tokens) for r in trace] == [
        (int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in rows
    ]
    # Same rows as the Azure fixture, so the arrivals agree to vidur's microsecond rounding.
    azure = T.load_azure(AZURE)
    assert np.allclose(trace.arrivals(), azure.arrivals(), atol=1e-6, rtol=0)


def test_vidur_optional_columns_and_sorting():
    trace = T.load_vidur(VIDUR_TENANTS)
    rows = _csv_rows(VIDUR_TENANTS)
    order = sorted(range(len(rows)), key=lambda i: float(rows[i]["arrived_at"]))
    t0 = float(rows[order[0]]["arrived_at"])
    assert [r.arrival for r in trace] == [float(rows[i]["arrived_at"]) - t0 for i in order]
    for req, i in zip(trace, order):
        row = rows[i]
        assert req.id == f"vidur_tenants-{i:06d}"  # id keeps the file row index
        assert req.tenant == (row["tenant"] or "default")
        assert req.type == (row["type"] or "chat")
        assert req.max_tokens == (
            int(row["max_tokens"]) if row["max_tokens"] else T.DEFAULT_MAX_TOKENS
        )
        assert req.output_tokens == int(
            row["num_decode_tokens"]
        )  # a recorded cap changes no output
        assert not req.truncated


@pytest.mark.parametrize(
    ("bad_row", "column"),
    [
        ("x,10,5,a,chat,", "arrived_at"),
        ("nan,10,5,a,chat,", "arrived_at"),
        ("3.0,0,5,a,chat,", "num_prefill_tokens"),
        ("3.0,10,-1,a,chat,", "num_decode_tokens"),
        ("3.0,10,5,a,poem,", "type"),
        ("3.0,10,5,a,chat,0", "max_tokens"),
    ],
)
def test_vidur_malformed_row(tmp_path, bad_row, column):
    text = (
        "arrived_at,num_prefill_tokens,num_decode_tokens,tenant,type,max_tokens\n"
        "0.0,1,1,a,chat,\n1.0,1,1,a,chat,\n2.0,1,1,a,chat,\n" + bad_row + "\n"
    )
    path = _write(tmp_path, "v.csv", text)
    with pytest.raises(TraceError) as info:
        T.load_vidur(path)
    assert str(info.value).startswith(f"{path}:5:")
    assert repr(column) in str(info.value)


def test_extra_field_is_an_error(tmp_path):
    path = _write(
        tmp_path, "v.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n1,2,2,3\n"
    )
    with pytest.raises(TraceError, match=r"v\.csv:3: row has 4 fields, header has 3"):
        T.load_vidur(path)


# ------------------------------------------------------------------------------------------
# Mooncake
# ------------------------------------------------------------------------------------------


def test_mooncake_fixture():
    objs = [json.loads(line) for line in MOONCAKE.read_text().splitlines() if line.strip()]
    trace = T.load_mooncake(MOONCAKE)
    assert len(trace) == len(objs)
    assert [r.arrival for r in trace] == [
        (o["timestamp"] - objs[0]["timestamp"]) / 1000 for o in objs
    ]
    assert [(r.prompt_tokens, r.output_tokens) for r in trace] == [
        (o["input_length"], o["output_length"]) for o in objs
    ]
    assert len({r.id for r in trace}) == len(objs)


@pytest.mark.parametrize(
    ("bad_line", "needle"),
    [
        ('{"timestamp": 5000, "input_length": 10, "output_length": 3', "invalid JSON"),
        ("[1, 2, 3]", "expected a JSON object"),
        ('{"timestamp": 5000, "output_length": 3}', "'input_length'"),
        ('{"timestamp": 5000, "input_length": 10, "output_length": 0}', "'output_length'"),
        ('{"timestamp": 5000, "input_length": 10.5, "output_length": 3}', "'input_length'"),
        ('{"timestamp": "soon", "input_length": 10, "output_length": 3}', "'timestamp'"),
        ('{"timestamp": true, "input_length": 10, "output_length": 3}', "'timestamp'"),
    ],
)
def test_mooncake_malformed_line(tmp_path, bad_line, needle):
    good = '{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [1]}'
    path = _write(tmp_path, "m.jsonl", "\n".join([good, "", good, bad_line, good]) + "\n")
    with pytest.raises(TraceError) as info:
        T.load_mooncake(path)
    assert str(info.value).startswith(f"{path}:4:")  # the blank line 2 still counts as a line
    assert needle in str(info.value)


# ------------------------------------------------------------------------------------------
# BurstGPT
# ------------------------------------------------------------------------------------------


def test_burstgpt_skips_and_counts_failures():
    rows = _csv_rows(BURSTGPT)
    ok = [(i, r) for i, r in enumerate(rows) if int(r["Response tokens"]) > 0]
    trace = T.load_burstgpt(BURSTGPT)
    assert trace.skipped == len(rows) - len(ok) > 0
    t0 = float(ok[0][1]["Timestamp"])
    assert [r.arrival for r in trace] == [float(r["Timestamp"]) - t0 for _, r in ok]
    assert [(r.prompt_tokens, r.output_tokens) for r in trace] == [
        (int(r["Request tokens"]), int(r["Response tokens"])) for _, r in ok
    ]
    assert [r.id for r in trace] == [f"burstgpt_sample-{i:06d}" for i, _ in ok]


def test_burstgpt_tenant_column():
    rows = [r for r in _csv_rows(BURSTGPT) if int(r["Response tokens"]) > 0]
    trace = T.load_burstgpt(BURSTGPT, tenant_column="Model")
    assert [r.tenant for r in trace] == [r["Model"] for r in rows]
    with pytest.raises(TraceError, match="missing column 'Owner'"):
        T.load_burstgpt(BURSTGPT, tenant_column="Owner")


@pytest.mark.parametrize(
    ("bad_row", "column"),
    [
        ("30,ChatGPT,0,12,12,API log", "Request tokens"),
        ("30,ChatGPT,10,-2,8,API log", "Response tokens"),
        ("later,ChatGPT,10,2,12,API log", "Timestamp"),
    ],
)
def test_burstgpt_malformed_row(tmp_path, bad_row, column):
    header = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    path = _write(
        tmp_path, "b.csv", header + "5,ChatGPT,472,18,490,Conversation log\n" + bad_row + "\n"
    )
    with pytest.raises(TraceError) as info:
        T.load_burstgpt(path)
    assert str(info.value).startswith(f"{path}:3:")
    assert repr(column) in str(info.value)


# ------------------------------------------------------------------------------------------
# Length-only CSVs and arrival processes
# ------------------------------------------------------------------------------------------


def test_lengths_fixture_poisson_seeded():
    rows = _csv_rows(LENGTHS)
    trace = T.load_lengths(LENGTHS, rate=4.0, seed=7)
    assert [(r.prompt_tokens, r.output_tokens) for r in trace] == [
        (int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in rows
    ]
    arrivals = trace.arrivals()
    assert arrivals[0] == 0.0 and np.all(np.diff(arrivals) > 0)
    again = T.load_lengths(LENGTHS, rate=4.0, seed=7)
    other = T.load_lengths(LENGTHS, rate=4.0, seed=8)
    assert again == trace
    assert not np.array_equal(other.arrivals(), arrivals)
    head = T.load_lengths(LENGTHS, rate=4.0, n=3)
    assert [r.prompt_tokens for r in head] == [int(r["num_prefill_tokens"]) for r in rows[:3]]
    with pytest.raises(TraceError, match="n=100"):
        T.load_lengths(LENGTHS, rate=4.0, n=100)


def test_lengths_malformed_row(tmp_path):
    text = "num_prefill_tokens,num_decode_tokens,num_total_tokens\n10,5,15\n12,abc,12\n"
    path = _write(tmp_path, "l.csv", text)
    with pytest.raises(TraceError) as info:
        T.load_lengths(path, rate=1.0)
    assert str(info.value).startswith(f"{path}:3:") and "'num_decode_tokens'" in str(info.value)


def _cv(x: np.ndarray) -> float:
    gaps = np.diff(x)
    return float(gaps.std() / gaps.mean())


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0, 4.0])
def test_gamma_arrivals_have_requested_cv_and_rate(cv):
    arrivals = T.generate_arrivals(20_000, rate=10.0, process="gamma", cv=cv, seed=3)
    assert len(arrivals) == 20_000 and arrivals[0] == 0.0
    assert _cv(arrivals) == pytest.approx(cv, rel=0.10)
    assert 1.0 / np.diff(arrivals).mean() == pytest.approx(10.0, rel=0.10 if cv < 3 else 0.15)


def test_lengths_gamma_process_cv_on_20k_rows(tmp_path):
    rng = np.random.default_rng(0)
    lines = ["num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio"]
    for p, d in rng.integers(1, 4000, size=(20_000, 2)).tolist():
        lines.append(f"{p},{d},{p + d},{p / d}")
    path = _write(tmp_path, "big.csv", "\n".join(lines) + "\n")
    trace = T.load_lengths(path, rate=5.0, process="gamma", cv=3.0, seed=1)
    assert len(trace) == 20_000
    assert _cv(trace.arrivals()) == pytest.approx(3.0, rel=0.10)
    poisson = T.load_lengths(path, rate=5.0, seed=1)
    assert _cv(poisson.arrivals()) == pytest.approx(1.0, rel=0.10)
    assert poisson.rate == pytest.approx(5.0, rel=0.05)


def test_arrival_process_argument_errors():
    with pytest.raises(ValueError, match="process"):
        T.generate_arrivals(10, rate=1.0, process="weibull")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rate"):
        T.generate_arrivals(10, rate=0.0)
    with pytest.raises(ValueError, match="gamma"):
        T.generate_arrivals(10, rate=1.0, cv=2.0)  # cv without process="gamma"


# ------------------------------------------------------------------------------------------
# ServeGen reasoning PMF
# ------------------------------------------------------------------------------------------


def test_servegen_reasoning_sampling():
    pmf: dict[str, dict[int, float]] = {"input_tokens": {}, "output_tokens": {}}
    for row in _csv_rows(SERVEGEN):
        if row["field"] in pmf:
            pmf[row["field"]][int(row["value"])] = float(row["prob"])
    n = 10_000
    trace = T.load_servegen_reasoning(SERVEGEN, n=n, rate=8.0, seed=5)
    assert len(trace) == n and {r.type for r in trace} == {"reasoning"}
    for field, values in (
        ("input_tokens", [r.prompt_tokens for r in trace]),
        ("output_tokens", [r.output_tokens for r in trace]),
    ):
        counts = Counter(values)
        assert set(counts) <= set(pmf[field])
        for value, p in pmf[field].items():
            assert counts[value] / n == pytest.approx(p, abs=0.02)
    assert trace == T.load_servegen_reasoning(SERVEGEN, n=n, rate=8.0, seed=5)
    assert trace != T.load_servegen_reasoning(SERVEGEN, n=n, rate=8.0, seed=6)


def test_servegen_bad_probabilities(tmp_path):
    text = "model,field,value,prob\nr1,input_tokens,5,0.5\nr1,output_tokens,9,1.0\n"
    with pytest.raises(TraceError, match=r"input_tokens probabilities sum to 0\.5"):
        T.load_servegen_reasoning(_write(tmp_path, "p.csv", text), n=5, rate=1.0)
    text = "model,field,value,prob\nr1,input_tokens,5,1.0\nr1,output_tokens,0,1.0\n"
    path = _write(tmp_path, "q.csv", text)
    with pytest.raises(TraceError) as info:
        T.load_servegen_reasoning(path, n=5, rate=1.0)
    assert str(info.value).startswith(f"{path}:3:") and "'value'" in str(info.value)


# ------------------------------------------------------------------------------------------
# load_trace dispatch
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "loader", "kw"),
    [
        (AZURE, T.load_azure, {}),
        (VIDUR, T.load_vidur, {}),
        (VIDUR_TENANTS, T.load_vidur, {}),
        (MOONCAKE, T.load_mooncake, {}),
        (BURSTGPT, T.load_burstgpt, {}),
        (LENGTHS, T.load_lengths, {"rate": 2.0, "seed": 4}),
        (SERVEGEN, T.load_servegen_reasoning, {"n": 50, "rate": 2.0}),
    ],
)
def test_load_trace_dispatches_by_content(path, loader, kw):
    assert T.load_trace(path, **kw) == loader(path, **kw)


def test_load_trace_jsonl_without_extension(tmp_path):
    path = tmp_path / "trace.txt"
    path.write_bytes(MOONCAKE.read_bytes())
    assert [r.prompt_tokens for r in T.load_trace(path)] == [
        r.prompt_tokens for r in T.load_mooncake(MOONCAKE)
    ]


def test_load_trace_unknown_format_names_file_and_header(tmp_path):
    path = _write(
        tmp_path, "weird.csv", "model,window_start_s,total_rate_rps,active_clients\nm,0,1.0,3\n"
    )
    with pytest.raises(TraceError) as info:
        T.load_trace(path)
    assert str(path) in str(info.value) and "window_start_s" in str(info.value)


def test_load_trace_lengths_needs_rate():
    with pytest.raises(TraceError, match="rate="):
        T.load_trace(LENGTHS)


# ------------------------------------------------------------------------------------------
# Data structures
# ------------------------------------------------------------------------------------------


def test_trace_sorts_by_arrival_then_id_and_rejects_duplicates():
    a = TraceRequest("b", 1.0, 1, 1, 1)
    b = TraceRequest("a", 1.0, 1, 1, 1)
    c = TraceRequest("c", 0.5, 1, 1, 1)
    trace = Trace("x", (a, b, c))
    assert [r.id for r in trace] == ["c", "a", "b"]
    assert trace.duration == 0.5 and trace.rate == 3 / 0.5
    with pytest.raises(ValueError, match="duplicate request id 'a'"):
        Trace("x", (a, b, TraceRequest("a", 2.0, 1, 1, 1)))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(prompt_tokens=0),
        dict(output_tokens=-1),
        dict(max_tokens=0),
        dict(type="poem"),
        dict(arrival=-1.0),
        dict(arrival=math.nan),
        dict(tenant=""),
    ],
)
def test_trace_request_rejects_invalid_fields(kwargs):
    base = dict(id="r", arrival=0.0, prompt_tokens=1, output_tokens=1, max_tokens=1)
    with pytest.raises(ValueError):
        TraceRequest(**{**base, **kwargs})


# ------------------------------------------------------------------------------------------
# Transforms
# ------------------------------------------------------------------------------------------


def test_scale_rate_and_target_rate():
    trace = T.load_azure(AZURE)
    doubled = T.scale_rate(trace, 2.0)
    assert doubled.rate == pytest.approx(2 * trace.rate, rel=1e-12)
    assert [r.arrival for r in doubled] == [r.arrival / 2 for r in trace]
    assert [r.prompt_tokens for r in doubled] == [r.prompt_tokens for r in trace]
    assert T.target_rate(trace, 3.0).rate == pytest.approx(3.0, rel=1e-12)
    with pytest.raises(ValueError):
        T.scale_rate(trace, 0.0)


def test_time_window_keeps_right_rows_and_rezeroes():
    trace = T.load_azure(AZURE)
    start, dur = 4.5, 2.0
    expected = [r for r in trace if start <= r.arrival < start + dur]
    assert 0 < len(expected) < len(trace)
    window = T.time_window(trace, start, dur)
    assert [r.id for r in window] == [r.id for r in expected]
    assert window.requests[0].arrival == 0.0
    assert [r.arrival for r in window] == pytest.approx(
        [r.arrival - expected[0].arrival for r in expected]
    )
    assert window.duration <= dur
    assert len(T.time_window(trace, 1e6, 10.0)) == 0


def test_cap_max_tokens():
    trace = T.load_vidur(VIDUR_TENANTS)
    capped = T.cap_max_tokens(trace, 50)
    for before, after in zip(trace, capped):
        assert after.max_tokens == min(before.max_tokens, 50)
        assert after.output_tokens == min(before.output_tokens, 50)
        assert after.prompt_tokens == before.prompt_tokens
        assert after.truncated == (before.output_tokens > 50)
    assert any(r.output_tokens > 50 for r in trace)  # the cap actually bit somewhere
    assert capped.truncated == sum(r.output_tokens > 50 for r in trace) and trace.truncated == 0


def test_scale_tokens_rounds_and_floors_at_one():
    trace = T.load_azure(AZURE)
    scaled = T.scale_tokens(trace, prompt_factor=0.5, output_factor=0.001)
    for before, after in zip(trace, scaled):
        assert after.prompt_tokens == max(1, round(before.prompt_tokens * 0.5))
        assert after.output_tokens == max(1, round(before.output_tokens * 0.001))
    assert min(r.output_tokens for r in scaled) == 1


def test_assign_tenants_zipf_seeded_and_skewed():
    trace = T.load_lengths(LENGTHS, rate=1.0)
    big = Trace(
        "big", tuple(TraceRequest(f"r{i:05d}", i * 0.01, 10, 10, 10) for i in range(10_000))
    )
    a = T.assign_tenants_zipf(big, 8, s=1.1, seed=1)
    assert a == T.assign_tenants_zipf(big, 8, s=1.1, seed=1)
    assert [r.tenant for r in a] != [r.tenant for r in T.assign_tenants_zipf(big, 8, s=1.1, seed=2)]
    counts = Counter(r.tenant for r in a)
    assert set(counts) <= {f"t{k}" for k in range(8)}
    assert counts.most_common(1)[0][0] == "t0"
    assert counts["t0"] > counts["t1"] > counts["t3"] > counts["t7"]
    weights = 1 / np.arange(1, 9) ** 1.1
    assert counts["t0"] / len(big) == pytest.approx(weights[0] / weights.sum(), abs=0.02)
    # Only tenants change.
    small = T.assign_tenants_zipf(trace, 3, seed=0)
    assert [(r.id, r.arrival, r.prompt_tokens) for r in small] == [
        (r.id, r.arrival, r.prompt_tokens) for r in trace
    ]


def test_assign_tenants_from_and_with_type():
    trace = T.load_azure(AZURE)
    by_size = T.assign_tenants_from(trace, lambda r: "long" if r.prompt_tokens > 500 else "short")
    assert [r.tenant for r in by_size] == [
        "long" if r.prompt_tokens > 500 else "short" for r in trace
    ]
    with pytest.raises(ValueError):
        T.assign_tenants_from(trace, lambda r: "")
    assert {r.type for r in T.with_type(trace, "batch")} == {"batch"}
    with pytest.raises(ValueError):
        T.with_type(trace, "poem")


def _many(n: int, prompt: int, type_: str, rate: float, prefix: str) -> Trace:
    arrivals = T.generate_arrivals(n, rate=rate, seed=n)
    return Trace(
        prefix,
        tuple(
            TraceRequest(f"{prefix}-{i:06d}", float(a), prompt + i % 7, 20, 256, type=type_)
            for i, a in enumerate(arrivals)
        ),
    )


def test_mix_fractions_and_arrivals():
    chat = _many(10_000, 100, "chat", 5.0, "conv")
    reasoning = _many(500, 3000, "reasoning", 1.0, "r1")
    mixed = T.mix([(chat, 0.3), (reasoning, 0.7)], seed=11)
    assert len(mixed) == len(chat)
    assert np.array_equal(mixed.arrivals(), chat.arrivals())  # the first part's arrival times
    share = sum(r.type == "reasoning" for r in mixed) / len(mixed)
    assert share == pytest.approx(0.7, abs=0.02)
    assert len({r.id for r in mixed}) == len(mixed)
    # Lengths come from the part that was drawn.
    for r in mixed:
        assert (r.prompt_tokens >= 3000) == (r.type == "reasoning")
    assert mixed == T.mix([(chat, 0.3), (reasoning, 0.7)], seed=11)
    assert mixed != T.mix([(chat, 0.3), (reasoning, 0.7)], seed=12)


def test_mix_n_and_duration_extend_with_poisson():
    base = _many(100, 100, "chat", 10.0, "conv")
    other = _many(50, 2000, "reasoning", 1.0, "r1")
    longer = T.mix([(base, 0.5), (other, 0.5)], n=1_000, seed=0)
    assert len(longer) == 1_000
    assert np.array_equal(longer.arrivals()[:100], base.arrivals())
    assert longer.rate == pytest.approx(base.rate, rel=0.2)
    windowed = T.mix([(base, 0.5), (other, 0.5)], duration_s=5.0, seed=0)
    assert np.array_equal(windowed.arrivals(), base.arrivals()[base.arrivals() < 5.0])


@pytest.mark.parametrize("fractions", [(0.3, 0.6), (0.5, 0.6), (1.2, -0.2)])
def test_mix_bad_fractions(fractions):
    a, b = _many(10, 100, "chat", 1.0, "a"), _many(10, 100, "batch", 1.0, "b")
    with pytest.raises(ValueError, match="fractions") as info:
        T.mix([(a, fractions[0]), (b, fractions[1])])
    assert str(fractions[0]) in str(info.value) and str(fractions[1]) in str(info.value)


def test_transforms_are_pure():
    trace = T.load_azure(AZURE)
    snapshot = trace.requests
    T.scale_rate(trace, 3.0)
    T.time_window(trace, 1.0, 3.0)
    T.cap_max_tokens(trace, 10)
    T.assign_tenants_zipf(trace, 4)
    T.mix([(trace, 1.0)], seed=0)
    assert trace.requests is snapshot and trace == T.load_azure(AZURE)


# ------------------------------------------------------------------------------------------
# Bundled window
# ------------------------------------------------------------------------------------------


def test_bundled_window():
    path = T.bundled_trace_path()
    assert path.is_file() and path.read_bytes().startswith(AZURE_HEADER.encode() + b"\r\n")
    trace = T.load_bundled()
    assert len(trace) > 1000
    assert trace.duration <= 600.0
    assert trace == T.load_azure(path, name="azure-conv-window", prefix="conv")
    # The window starts with the same rows as the fixture taken from the head of the same file.
    head = T.load_azure(AZURE)
    assert [(r.arrival, r.prompt_tokens, r.output_tokens) for r in trace.requests[: len(head)]] == [
        (r.arrival, r.prompt_tokens, r.output_tokens) for r in head
    ]


# ------------------------------------------------------------------------------------------
# max_tokens is the client's cap, never the true output length
# ------------------------------------------------------------------------------------------
#
# A policy sees max_tokens (TIE truncates its length distribution there and scores unpredicted
# requests with it; predictions are capped by it), so a loader that filled it from the output
# length would hand every policy the ground truth. Each format below is written with outputs that
# vary and straddle both caps used (the default 4,096 and an override of 300); requests whose
# source records no cap must all get the same cap, whatever their output.

LEAK_OUTPUTS = [1, 7, 44, 299, 300, 301, 1000, 4095, 4096, 4097, 9000, 32768]
LEAK_PROMPTS = [5 + 37 * i for i in range(len(LEAK_OUTPUTS))]
# A per-request cap column: some rows record one (below, equal to and above their output), some not.
RECORDED = [None, 8, None, 300, 64, None, 5000, None, 100, None, 20000, None]
BIG_CAP = 10**9  # a cap nothing reaches: the loaders' uncapped draws


def _ids_for(stem: str, indices) -> list[str]:
    return [f"{stem}-{i:06d}" for i in indices]


def _expect(stem: str, indices, outputs, recorded=None) -> dict[str, tuple[int, int | None]]:
    """Request id -> (source output, recorded cap or None), computed from what was written."""
    recorded = recorded or [None] * len(outputs)
    return dict(zip(_ids_for(stem, indices), zip(outputs, recorded)))


def _fmt_azure(tmp_path):
    lines = [AZURE_HEADER] + [
        f"2023-11-16 18:15:{10 + i:02d}.5000000,{p},{o}"
        for i, (p, o) in enumerate(zip(LEAK_PROMPTS, LEAK_OUTPUTS))
    ]
    path = _write(tmp_path, "az.csv", "\r\n".join(lines) + "\r\n")
    return path, {}, _expect("az", range(len(LEAK_OUTPUTS)), LEAK_OUTPUTS)


def _fmt_vidur(tmp_path):
    lines = ["arrived_at,num_prefill_tokens,num_decode_tokens"]
    lines += [f"{0.25 * i},{p},{o}" for i, (p, o) in enumerate(zip(LEAK_PROMPTS, LEAK_OUTPUTS))]
    path = _write(tmp_path, "vid.csv", "\n".join(lines) + "\n")
    return path, {}, _expect("vid", range(len(LEAK_OUTPUTS)), LEAK_OUTPUTS)


def _fmt_vidur_recorded(tmp_path):
    lines = ["arrived_at,num_prefill_tokens,num_decode_tokens,max_tokens"]
    lines += [
        f"{0.25 * i},{p},{o},{'' if m is None else m}"
        for i, (p, o, m) in enumerate(zip(LEAK_PROMPTS, LEAK_OUTPUTS, RECORDED))
    ]
    path = _write(tmp_path, "vidcap.csv", "\n".join(lines) + "\n")
    return path, {}, _expect("vidcap", range(len(LEAK_OUTPUTS)), LEAK_OUTPUTS, RECORDED)


def _fmt_mooncake(tmp_path):
    lines = [
        json.dumps(
            {"timestamp": 1000 + 250 * i, "input_length": p, "output_length": o, "hash_ids": [i]}
        )
        for i, (p, o) in enumerate(zip(LEAK_PROMPTS, LEAK_OUTPUTS))
    ]
    path = _write(tmp_path, "moon.jsonl", "\n".join(lines) + "\n")
    return path, {}, _expect("moon", range(len(LEAK_OUTPUTS)), LEAK_OUTPUTS)


def _fmt_burstgpt(tmp_path):
    lines = [
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
        "0,ChatGPT,10,0,10,Conversation log",
    ]  # a failure: skipped, but it keeps its row index
    lines += [
        f"{i + 1},GPT-4,{p},{o},{p + o},API log"
        for i, (p, o) in enumerate(zip(LEAK_PROMPTS, LEAK_OUTPUTS))
    ]
    path = _write(tmp_path, "bgpt.csv", "\n".join(lines) + "\n")
    return path, {}, _expect("bgpt", range(1, len(LEAK_OUTPUTS) + 1), LEAK_OUTPUTS)


def _fmt_lengths(tmp_path):
    lines = ["num_prefill_tokens,num_decode_tokens,num_total_tokens"]
    lines += [f"{p},{o},{p + o}" for p, o in zip(LEAK_PROMPTS, LEAK_OUTPUTS)]
    path = _write(tmp_path, "len.csv", "\n".join(lines) + "\n")
    return path, {"rate": 3.0, "seed": 2}, _expect("len", range(len(LEAK_OUTPUTS)), LEAK_OUTPUTS)


def _fmt_lengths_recorded(tmp_path):
    lines = ["num_prefill_tokens,num_decode_tokens,max_tokens"]
    lines += [
        f"{p},{o},{'' if m is None else m}" for p, o, m in zip(LEAK_PROMPTS, LEAK_OUTPUTS, RECORDED)
    ]
    path = _write(tmp_path, "lencap.csv", "\n".join(lines) + "\n")
    return path, {"rate": 3.0}, _expect("lencap", range(len(LEAK_OUTPUTS)), LEAK_OUTPUTS, RECORDED)


def _fmt_servegen(tmp_path):
    p = 1 / len(LEAK_OUTPUTS)
    lines = ["model,field,value,prob", "r1,input_tokens,16,0.5", "r1,input_tokens,4096,0.5"]
    lines += [f"r1,output_tokens,{o},{p!r}" for o in LEAK_OUTPUTS] + ["r1,reason_ratio,0.5,1.0"]
    path = _write(tmp_path, "pmf.csv", "\n".join(lines) + "\n")
    kw = {"n": 600, "rate": 4.0, "seed": 9}
    # The PMF's draws do not depend on the cap: an uncapped load gives each request's source output.
    uncapped = T.load_servegen_reasoning(path, **kw, max_tokens_default=BIG_CAP)
    assert set(LEAK_OUTPUTS) == {
        r.output_tokens for r in uncapped
    }  # every value drawn, over both caps
    return path, kw, {r.id: (r.output_tokens, None) for r in uncapped}


LOADER_FORMATS = {
    "azure": (_fmt_azure, T.load_azure),
    "vidur": (_fmt_vidur, T.load_vidur),
    "vidur-recorded-caps": (_fmt_vidur_recorded, T.load_vidur),
    "mooncake": (_fmt_mooncake, T.load_mooncake),
    "burstgpt": (_fmt_burstgpt, T.load_burstgpt),
    "lengths": (_fmt_lengths, T.load_lengths),
    "lengths-recorded-caps": (_fmt_lengths_recorded, T.load_lengths),
    "servegen": (_fmt_servegen, T.load_servegen_reasoning),
}


def _check_caps(trace: Trace, expected: dict[str, tuple[int, int | None]], cap: int) -> None:
    """Every request's cap is the recorded one, else `cap`; outputs over `cap` are truncated to it
    and counted; and no request without a recorded cap has a cap that follows its output."""
    assert {r.id for r in trace} == set(expected)
    truncated = 0
    for r in trace:
        source, recorded = expected[r.id]
        if recorded is not None:
            assert (r.max_tokens, r.output_tokens, r.truncated) == (recorded, source, False), r
        else:
            assert r.max_tokens == cap, r
            assert r.output_tokens == min(source, cap), r
            assert r.truncated == (source > cap), r
            truncated += source > cap
    assert trace.truncated == truncated
    free = [r for r in trace if expected[r.id][1] is None]
    assert len({r.output_tokens for r in free}) >= 3  # the outputs vary ...
    assert {r.max_tokens for r in free} == {cap}  # ... and the cap does not
    # The leak, stated directly: a cap equal to the output only where the output reached the cap.
    assert all(r.output_tokens == cap for r in free if r.max_tokens == r.output_tokens)


@pytest.mark.parametrize("fmt", sorted(LOADER_FORMATS))
def test_loaders_never_derive_max_tokens_from_the_output(tmp_path, fmt):
    make, loader = LOADER_FORMATS[fmt]
    path, kw, expected = make(tmp_path)
    trace = loader(path, **kw)
    _check_caps(trace, expected, T.DEFAULT_MAX_TOKENS)
    assert T.load_trace(path, **kw) == trace  # the auto-detecting entry point agrees


@pytest.mark.parametrize("fmt", sorted(LOADER_FORMATS))
def test_max_tokens_default_overrides_the_cap_per_load(tmp_path, fmt):
    make, loader = LOADER_FORMATS[fmt]
    path, kw, expected = make(tmp_path)
    trace = loader(path, **kw, max_tokens_default=300)
    _check_caps(trace, expected, 300)
    assert T.load_trace(path, **kw, max_tokens_default=300) == trace
    assert trace.truncated > loader(path, **kw).truncated  # a lower cap truncates more
    # Arrivals, prompts and ids do not depend on the cap.
    assert [(r.id, r.arrival, r.prompt_tokens) for r in trace] == [
        (r.id, r.arrival, r.prompt_tokens) for r in loader(path, **kw)
    ]


def test_truncation_count_is_exact_and_carried_by_transforms(tmp_path):
    path, _, _ = _fmt_azure(tmp_path)
    over_default = sum(o > T.DEFAULT_MAX_TOKENS for o in LEAK_OUTPUTS)
    over_300 = sum(o > 300 for o in LEAK_OUTPUTS)
    assert (over_default, over_300) == (3, 7)
    trace = T.load_azure(path)
    assert trace.truncated == over_default
    assert [r.output_tokens for r in trace] == [min(o, T.DEFAULT_MAX_TOKENS) for o in LEAK_OUTPUTS]
    assert T.load_azure(path, max_tokens_default=300).truncated == over_300
    assert T.load_azure(path, max_tokens_default=BIG_CAP).truncated == 0
    # Transforms that keep every request keep the count; a window counts what it keeps.
    for t in (
        T.scale_rate(trace, 2.0),
        T.target_rate(trace, 1.0),
        T.assign_tenants_zipf(trace, 3),
        T.with_type(trace, "batch"),
        T.scale_tokens(trace, 2.0, 0.5),
        T.transform(trace, tenants=2),
    ):
        assert t.truncated == over_default
    window = T.time_window(trace, 0.0, 10.0)  # rows 0..9: outputs up to 4097
    assert window.truncated == 1 and len(window) == 10
    # --max-tokens-cap truncates too: it adds the requests it cuts (each counted once).
    assert T.cap_max_tokens(trace, 300).truncated == over_300
    assert (
        T.cap_max_tokens(trace, 300).truncated
        == T.load_azure(path, max_tokens_default=300).truncated
    )
    # BurstGPT keeps its failures apart from truncations.
    bpath, _, _ = _fmt_burstgpt(tmp_path)
    bt = T.load_burstgpt(bpath)
    assert (bt.skipped, bt.truncated) == (1, over_default)
    # A mix counts the truncated requests it drew.
    mixed = T.mix([(trace, 0.5), (T.load_azure(path, max_tokens_default=300), 0.5)], n=200, seed=3)
    assert mixed.truncated == sum(r.truncated for r in mixed) > 0


def test_max_tokens_default_is_validated(tmp_path):
    path, _, _ = _fmt_azure(tmp_path)
    for bad in (0, -5, True, 2.5, "4096", None):
        with pytest.raises(ValueError, match="max_tokens_default"):
            T.load_azure(path, max_tokens_default=bad)
        with pytest.raises(ValueError, match="max_tokens_default"):
            T.load_bundled(max_tokens_default=bad)
    assert T.load_azure(path, max_tokens_default=np.int64(300)) == T.load_azure(
        path, max_tokens_default=300
    )


def test_bundled_trace_has_a_fixed_cap():
    rows = _csv_rows(T.bundled_trace_path())
    outputs = [int(r["GeneratedTokens"]) for r in rows]
    trace = T.load_bundled()
    _check_caps(trace, _expect("conv", range(len(rows)), outputs), T.DEFAULT_MAX_TOKENS)
    assert (
        trace.truncated == 0 and max(outputs) == 1000
    )  # the window's longest output is far below 4,096
    low = T.load_bundled(max_tokens_default=500)
    _check_caps(low, _expect("conv", range(len(rows)), outputs), 500)
    assert low.truncated == sum(o > 500 for o in outputs) > 0


def test_mix_and_token_scaling_keep_the_cap_independent_of_the_output(tmp_path):
    apath, _, aexp = _fmt_azure(tmp_path)
    spath, skw, sexp = _fmt_servegen(tmp_path)
    chat = T.load_azure(apath)
    reasoning = T.load_servegen_reasoning(spath, **skw, max_tokens_default=8192)
    mixed = T.mix([(chat, 0.5), (reasoning, 0.5)], n=400, seed=1)
    for r in mixed:
        source_id = r.id.split("-", 1)[1]
        source, cap = (
            (aexp[source_id][0], T.DEFAULT_MAX_TOKENS)
            if r.type == "chat"
            else (sexp[source_id][0], 8192)
        )
        assert (r.max_tokens, r.output_tokens, r.truncated) == (cap, min(source, cap), source > cap)
    assert {r.max_tokens for r in mixed} == {T.DEFAULT_MAX_TOKENS, 8192}
    assert len({r.output_tokens for r in mixed}) > 5
    # Token scaling scales the cap with the outputs: still one cap for all, and outputs within it.
    for f in (0.5, 1.7):
        scaled = T.scale_tokens(chat, prompt_factor=2.0, output_factor=f)
        assert {r.max_tokens for r in scaled} == {round(T.DEFAULT_MAX_TOKENS * f)}
        assert len({r.output_tokens for r in scaled}) > 5
        assert all(r.output_tokens <= r.max_tokens for r in scaled)
        assert [r.truncated for r in scaled] == [r.truncated for r in chat]
    # The other transforms never touch the cap.
    for t in (
        T.time_window(chat, 1.0, 5.0),
        T.scale_rate(chat, 3.0),
        T.target_rate(chat, 2.0),
        T.assign_tenants_zipf(chat, 4),
        T.with_type(chat, "completion"),
        T.transform(chat, window=(0.0, 8.0), rate_scale=2.0, tenants=3),
    ):
        assert {r.max_tokens for r in t} == {T.DEFAULT_MAX_TOKENS}
    capped = T.cap_max_tokens(chat, 1000)
    assert {r.max_tokens for r in capped} == {1000}
    assert [r.output_tokens for r in capped] == [min(o, 1000) for o in LEAK_OUTPUTS]
