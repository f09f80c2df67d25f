"""Workload traces for the tuner: loaders for public LLM-serving traces, and pure transforms.

A trace is an immutable, arrival-sorted sequence of `TraceRequest`s (docs/engine.md#requests): arrival time in
seconds relative to the first request, prompt and output token counts, `max_tokens`, tenant and
request type. Every loader re-zeroes arrivals so the first request arrives at 0.0, gives each
request an id `<prefix>-<row index>` (0-based data-row index, zero-padded so ids sort in file
order), and reports malformed input as a `TraceError` whose message starts with
`<file>:<line>:` (1-based, header = line 1) and names the offending column. Nothing is dropped
silently: the only loader that drops rows by design (BurstGPT failures) counts them in
`Trace.skipped`.

`max_tokens` is the client's cap, never the true output length (a policy sees `max_tokens`; were it
the output length, every policy would be an oracle). Formats that record a per-request cap (the
`max_tokens` column of vidur/length-only CSVs) keep it; for every other request the loaders use one
fixed cap, `DEFAULT_MAX_TOKENS` unless the `max_tokens_default=` keyword says otherwise, and a
request whose recorded output is longer than that cap is truncated to it, as a server would do:
such requests are flagged (`TraceRequest.truncated`) and counted (`Trace.truncated`).

Supported formats (see `load_trace` for auto-detection):

* Azure LLM inference 2023 CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`)  -> `load_azure`
* vidur processed traces (`arrived_at,num_prefill_tokens,num_decode_tokens`) -> `load_vidur`
* Mooncake JSONL (`timestamp` in ms, `input_length`, `output_length`)        -> `load_mooncake`
* BurstGPT CSV (`Timestamp,Model,Request tokens,Response tokens,...`)        -> `load_burstgpt`
* length-only CSVs (`num_prefill_tokens,num_decode_tokens,...`) + a generated
  Poisson/Gamma arrival process                                              -> `load_lengths`
* ServeGen-derived length PMFs (`model,field,value,prob`), reasoning type    -> `load_servegen_reasoning`

Bundled data: `sim/data/azure_conv_window.csv` holds the first 600 s (2,867 rows, byte-for-byte,
same header) of AzureLLMInferenceTrace_conv.csv from Azure/AzurePublicDataset, licensed CC BY 4.0;
please cite Patel et al., "Splitwise: Efficient Generative LLM Inference Using Phase Splitting",
ISCA 2024. See `bundled_trace_path()` and `load_bundled()`.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as _dt
import inspect
import json
import math
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import IO, Literal

import numpy as np

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "REQUEST_TYPES",
    "Trace",
    "TraceError",
    "TraceRequest",
    "assign_tenants_from",
    "assign_tenants_zipf",
    "bundled_trace_path",
    "cap_max_tokens",
    "generate_arrivals",
    "load_azure",
    "load_bundled",
    "load_burstgpt",
    "load_lengths",
    "load_mooncake",
    "load_servegen_reasoning",
    "load_trace",
    "load_vidur",
    "mix",
    "scale_rate",
    "scale_tokens",
    "target_rate",
    "time_window",
    "with_type",
]

REQUEST_TYPES: frozenset[str] = frozenset({"chat", "completion", "reasoning", "batch", "embed"})

ArrivalProcess = Literal["poisson", "gamma"]
PathLike = str | os.PathLike[str]

BUNDLED_FILE = "azure_conv_window.csv"

# The client cap given to requests whose source records none: one value for every request, so it
# tells a policy nothing about any request's length. Loaders take `max_tokens_default=` to change it
# (the command line's --max-tokens-default).
DEFAULT_MAX_TOKENS = 4096


# --------------------------------------------------------------------------------------------
# Data structures
# --------------------------------------------------------------------------------------------


class TraceError(ValueError):
    """A trace file is missing, unreadable or malformed.

    The message is `<file>:<line>: <what is wrong>` for row-level problems (header = line 1), or
    `<file>: <what is wrong>` for problems with the file as a whole.
    """


class ArrivalsNeeded(TraceError):
    """The file has lengths but no arrival times; ``needs`` names the generation arguments it
    takes (``("rate",)`` for length-only CSVs, ``("n", "rate")`` for a length distribution)."""

    def __init__(self, message: str, needs: tuple[str, ...]) -> None:
        super().__init__(message)
        self.needs = needs


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One request of a workload trace (docs/engine.md#requests).

    `output_tokens` is the true output length, `max_tokens` the client's cap; the simulator
    generates `min(output_tokens, max_tokens)` tokens. `max_tokens` never derives from the output
    length: sources without a cap get a fixed one (`DEFAULT_MAX_TOKENS`, or the loader's
    `max_tokens_default`). `truncated` marks a request whose source output was longer than its cap
    and was cut to it (by that default cap at load time, or by `cap_max_tokens`).
    """

    id: str
    arrival: float  # seconds, relative to the trace start
    prompt_tokens: int
    output_tokens: int
    max_tokens: int
    tenant: str = "default"
    type: str = "chat"
    truncated: bool = False

    def __post_init__(self) -> None:
        # Cheap invariant checks: a bad request would otherwise surface deep in the simulator.
        if not (math.isfinite(self.arrival) and self.arrival >= 0.0):
            raise ValueError(f"request {self.id!r}: arrival must be finite and >= 0, got {self.arrival}")
        if self.prompt_tokens < 1 or self.output_tokens < 1 or self.max_tokens < 1:
            raise ValueError(
                f"request {self.id!r}: token counts must be >= 1, got prompt={self.prompt_tokens} "
                f"output={self.output_tokens} max_tokens={self.max_tokens}"
            )
        if self.type not in REQUEST_TYPES:
            raise ValueError(f"request {self.id!r}: type must be one of {sorted(REQUEST_TYPES)}, got {self.type!r}")
        if not self.tenant:
            raise ValueError(f"request {self.id!r}: tenant must be a non-empty string")


@dataclass(slots=True, frozen=True)
class Trace:
    """An immutable workload: requests sorted by (arrival, id), ids unique.

    `skipped` counts source rows a loader dropped by design (e.g. BurstGPT failures); transforms
    carry it along so the provenance is not lost. `truncated` (a property) counts the requests
    whose output was cut to their cap (see `TraceRequest.truncated`).
    """

    name: str
    requests: tuple[TraceRequest, ...]
    skipped: int = 0

    def __post_init__(self) -> None:
        # Normalize here rather than trusting callers: every consumer may rely on the order.
        ordered = tuple(sorted(self.requests, key=_arrival_then_id))
        if len({r.id for r in ordered}) != len(ordered):
            counts = Counter(r.id for r in ordered)
            dup = next(i for i, c in counts.items() if c > 1)
            raise ValueError(f"trace {self.name!r}: duplicate request id {dup!r}")
        object.__setattr__(self, "requests", ordered)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def truncated(self) -> int:
        """Requests whose source output was longer than their cap and was truncated to it."""
        return sum(1 for r in self.requests if r.truncated)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def duration(self) -> float:
        """Last arrival minus first arrival, in seconds (0.0 for fewer than two requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival - self.requests[0].arrival

    @property
    def rate(self) -> float:
        """Mean arrival rate in req/s: requests / duration, as in traces/README.md.

        0.0 for fewer than two requests (no rate can be observed); inf when two or more
        requests all arrive at the same instant.
        """
        if len(self.requests) < 2:
            return 0.0
        duration = self.duration
        return math.inf if duration == 0.0 else len(self.requests) / duration

    def arrivals(self) -> np.ndarray:
        """Arrival times as a float64 array (in trace order)."""
        return np.fromiter((r.arrival for r in self.requests), dtype=np.float64, count=len(self.requests))


def _arrival_then_id(r: TraceRequest) -> tuple[float, str]:
    return (r.arrival, r.id)


# --------------------------------------------------------------------------------------------
# Field parsing: every helper raises TraceError("<file>:<line>: column '<c>': ...")
# --------------------------------------------------------------------------------------------


def _err(where: str, line: int, column: str, what: str) -> TraceError:
    return TraceError(f"{where}:{line}: column {column!r}: {what}")


def _parse_tokens(text: str, where: str, line: int, column: str, minimum: int = 1) -> int:
    """A token count: an integer >= minimum. Integral float text ("12.0", as pandas writes) is accepted."""
    value: int | None
    try:
        value = int(text)
    except ValueError:
        value = _integral_float(text)
        if value is None:
            if not text.strip():
                raise _err(where, line, column, "empty value, expected a token count") from None
            raise _err(where, line, column, f"{text!r} is not an integer token count") from None
    if value < minimum:
        raise _err(where, line, column, f"token count must be >= {minimum}, got {value}")
    return value


def _integral_float(text: str) -> int | None:
    try:
        f = float(text)
    except ValueError:
        return None
    return int(f) if math.isfinite(f) and f.is_integer() else None


def _parse_float(text: str, where: str, line: int, column: str) -> float:
    try:
        value = float(text)
    except ValueError:
        what = "empty value, expected a number" if not text.strip() else f"{text!r} is not a number"
        raise _err(where, line, column, what) from None
    if not math.isfinite(value):
        raise _err(where, line, column, f"{text!r} is not a finite number")
    return value


def _parse_type(text: str, where: str, line: int, column: str) -> str:
    value = text.strip() or "chat"  # an empty cell means "not specified" -> the default type
    if value not in REQUEST_TYPES:
        raise _err(where, line, column, f"{text!r} is not one of {sorted(REQUEST_TYPES)}")
    return value


# Azure timestamps: "2023-11-16 18:15:46.6805900" (7 fractional digits = 100 ns ticks).
_AZURE_TS = re.compile(r"((\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2})):(\d{2})(?:\.(\d{1,7}))?")
_TICKS_PER_S = 10_000_000


class _AzureClock:
    """Parses Azure timestamps to integer 100-ns ticks, exactly (no float, no pandas).

    The "YYYY-MM-DD HH:MM" part is converted once per distinct minute and cached: a trace spans
    few minutes compared with its rows, and this keeps the 19k-row conv file well under 0.1 s.
    """

    __slots__ = ("_minutes",)

    def __init__(self) -> None:
        self._minutes: dict[str, int] = {}

    def ticks(self, text: str, where: str, line: int, column: str) -> int:
        m = _AZURE_TS.fullmatch(text.strip())
        if m is None:
            raise _err(where, line, column, f"{text!r} is not a timestamp 'YYYY-MM-DD HH:MM:SS.fffffff'")
        minute, ss, frac = m.group(1, 7, 8)
        base = self._minutes.get(minute)
        if base is None:
            base = self._minute_seconds(m, text, where, line, column)
            self._minutes[minute] = base
        s = int(ss)
        if s > 59:
            raise _err(where, line, column, f"{text!r}: seconds out of range")
        return (base + s) * _TICKS_PER_S + (int(frac.ljust(7, "0")) if frac else 0)

    @staticmethod
    def _minute_seconds(m: re.Match[str], text: str, where: str, line: int, column: str) -> int:
        y, mo, d, hh, mi = (int(g) for g in m.group(2, 3, 4, 5, 6))
        try:
            day = _dt.date(y, mo, d).toordinal()
        except ValueError as e:
            raise _err(where, line, column, f"{text!r}: {e}") from None
        if hh > 23 or mi > 59:
            raise _err(where, line, column, f"{text!r}: time of day out of range")
        return ((day * 24 + hh) * 60 + mi) * 60


# --------------------------------------------------------------------------------------------
# File access
# --------------------------------------------------------------------------------------------


def _open(path: PathLike) -> IO[str]:
    # utf-8-sig: tolerate a BOM written by spreadsheet tools; newline="" as the csv module wants.
    try:
        return open(path, newline="", encoding="utf-8-sig")
    except FileNotFoundError:
        raise TraceError(f"{os.fspath(path)}: no such file") from None
    except OSError as e:
        raise TraceError(f"{os.fspath(path)}: cannot open: {e.strerror or e}") from None


class _CsvRows:
    """A CSV file's header (column -> index) and its data rows with 1-based line numbers.

    Blank lines carry no request and are passed over; a row whose field count differs from the
    header is an error (an unquoted comma or a truncated row would otherwise shift columns).
    """

    def __init__(self, f: IO[str], where: str, required: Sequence[str]) -> None:
        self.where = where
        self._reader = csv.reader(f)
        try:
            header = next(self._reader, None)
        except (csv.Error, UnicodeDecodeError) as e:
            raise TraceError(f"{where}:1: cannot read header: {e}") from None
        if header is None:
            raise TraceError(f"{where}:1: empty file, expected a header with columns {list(required)}")
        self.header = [h.strip() for h in header]
        self.columns: dict[str, int] = {}
        for i, name in enumerate(self.header):
            if name in self.columns:
                raise TraceError(f"{where}:1: duplicate column {name!r}")
            self.columns[name] = i
        for name in required:
            if name not in self.columns:
                raise TraceError(f"{where}:1: missing column {name!r} (header: {','.join(self.header)})")

    def __iter__(self) -> Iterator[tuple[int, list[str]]]:
        reader, width = self._reader, len(self.header)
        try:
            for row in reader:
                if not row:
                    continue
                if len(row) != width:
                    line = reader.line_num
                    if len(row) < width:
                        what = f"missing (row has {len(row)} of {width} fields)"
                        raise _err(self.where, line, self.header[len(row)], what)
                    raise TraceError(f"{self.where}:{line}: row has {len(row)} fields, header has {width}")
                yield reader.line_num, row
        except (csv.Error, UnicodeDecodeError) as e:
            raise TraceError(f"{self.where}:{reader.line_num}: {e}") from None


def _ids(prefix: str, indices: Sequence[int]) -> list[str]:
    # Zero-pad to one width per trace so lexicographic id order == row order (ties in arrival).
    width = max(6, len(str(max(indices, default=0))))
    return [f"{prefix}-{i:0{width}d}" for i in indices]


def _default_name(path: PathLike) -> str:
    stem = Path(os.fspath(path)).stem
    if stem.startswith("AzureLLMInferenceTrace_"):
        return "azure-" + stem.removeprefix("AzureLLMInferenceTrace_")
    return stem


def _default_prefix(path: PathLike) -> str:
    stem = Path(os.fspath(path)).stem
    return stem.removeprefix("AzureLLMInferenceTrace_")


class _Rows:
    """Column-oriented accumulator for parsed rows, turned into a re-zeroed Trace at the end."""

    __slots__ = ("index", "arrival", "prompt", "output", "max_tokens", "tenant", "type")

    def __init__(self) -> None:
        self.index: list[int] = []
        self.arrival: list[float] = []
        self.prompt: list[int] = []
        self.output: list[int] = []
        self.max_tokens: list[int | None] = []
        self.tenant: list[str] = []
        self.type: list[str] = []

    def add(self, index: int, arrival: float, prompt: int, output: int,
            max_tokens: int | None = None, tenant: str = "default", type: str = "chat") -> None:
        self.index.append(index)
        self.arrival.append(arrival)
        self.prompt.append(prompt)
        self.output.append(output)
        self.max_tokens.append(max_tokens)
        self.tenant.append(tenant)
        self.type.append(type)

    def to_trace(self, name: str, prefix: str, default_cap: int, *, skipped: int = 0) -> Trace:
        t0 = min(self.arrival, default=0.0)  # re-zero: the first request arrives at 0.0
        ids = _ids(prefix, self.index)
        requests = tuple(
            _request(rid, a - t0, p, o, m, default_cap, ten, typ)
            for rid, a, p, o, m, ten, typ in zip(
                ids, self.arrival, self.prompt, self.output, self.max_tokens, self.tenant, self.type
            )
        )
        return Trace(name, requests, skipped)


def _request(rid: str, arrival: float, prompt: int, output: int, recorded_cap: int | None, default_cap: int,
             tenant: str = "default", type: str = "chat") -> TraceRequest:
    """A source row as a request. A cap the source recorded is kept as it is; a row without one gets
    `default_cap`, and an output longer than that is truncated to it (as a server would) and flagged.
    Never `max_tokens = output`: the cap must not tell a policy the true length."""
    if recorded_cap is not None:
        return TraceRequest(rid, arrival, prompt, output, recorded_cap, tenant, type)
    if output > default_cap:
        return TraceRequest(rid, arrival, prompt, default_cap, default_cap, tenant, type, truncated=True)
    return TraceRequest(rid, arrival, prompt, output, default_cap, tenant, type)


def _check_cap(value: int, label: str = "max_tokens_default") -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{label} must be an integer >= 1, got {value!r}")
    return int(value)


def _optional_extras(rows: _CsvRows) -> Callable[[int, list[str]], tuple[int | None, str, str]]:
    """Reader for the optional `max_tokens`, `tenant` and `type` columns of vidur/lengths CSVs."""
    where, cols = rows.where, rows.columns
    i_max, i_tenant, i_type = cols.get("max_tokens"), cols.get("tenant"), cols.get("type")

    def extras(line: int, row: list[str]) -> tuple[int | None, str, str]:
        max_tokens = None
        if i_max is not None and row[i_max].strip():
            max_tokens = _parse_tokens(row[i_max], where, line, "max_tokens")
        tenant = row[i_tenant].strip() if i_tenant is not None else ""
        typ = _parse_type(row[i_type], where, line, "type") if i_type is not None else "chat"
        return max_tokens, tenant or "default", typ

    return extras


# --------------------------------------------------------------------------------------------
# Loaders
# --------------------------------------------------------------------------------------------


def load_azure(path: PathLike, *, name: str | None = None, prefix: str | None = None,
               max_tokens_default: int = DEFAULT_MAX_TOKENS) -> Trace:
    """Load an Azure LLM inference 2023 CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`).

    Timestamps are parsed exactly to 100 ns (integer ticks, then one division), so arrivals are
    the correctly rounded float of the true offset. The format is sorted by time: a timestamp
    earlier than the previous row's is an error (equal ones are accepted). The format records no
    client cap: every request gets `max_tokens_default` (longer outputs are truncated to it).
    """
    cap = _check_cap(max_tokens_default)
    where = os.fspath(path)
    with _open(path) as f:
        return _parse_azure(f, where, name or _default_name(path), prefix or _default_prefix(path), cap)


def _parse_azure(f: IO[str], where: str, name: str, prefix: str, cap: int) -> Trace:
    rows = _CsvRows(f, where, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    i_ts, i_in, i_out = (rows.columns[c] for c in ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    clock = _AzureClock()
    ticks: list[int] = []
    prompt: list[int] = []
    output: list[int] = []
    for line, row in rows:
        t = clock.ticks(row[i_ts], where, line, "TIMESTAMP")
        if ticks and t < ticks[-1]:
            raise _err(where, line, "TIMESTAMP",
                       f"{row[i_ts].strip()!r} is earlier than the previous row's (the format is sorted by time)")
        ticks.append(t)
        prompt.append(_parse_tokens(row[i_in], where, line, "ContextTokens"))
        output.append(_parse_tokens(row[i_out], where, line, "GeneratedTokens"))
    t0 = ticks[0] if ticks else 0
    ids = _ids(prefix, range(len(ticks)))
    # int / int true division is correctly rounded: arrival = nearest float to the exact offset.
    requests = tuple(
        _request(rid, (t - t0) / _TICKS_PER_S, p, o, None, cap) for rid, t, p, o in zip(ids, ticks, prompt, output)
    )
    return Trace(name, requests)


def load_vidur(path: PathLike, *, name: str | None = None, prefix: str | None = None,
               max_tokens_default: int = DEFAULT_MAX_TOKENS) -> Trace:
    """Load a vidur trace CSV (`arrived_at,num_prefill_tokens,num_decode_tokens`, seconds).

    Optional columns: `max_tokens`, `tenant`, `type` (empty cells mean "default"/"chat"/no cap).
    A recorded `max_tokens` is kept; a row without one gets `max_tokens_default`. Rows need not be
    sorted; the trace is sorted and re-zeroed.
    """
    cap = _check_cap(max_tokens_default)
    where = os.fspath(path)
    with _open(path) as f:
        rows = _CsvRows(f, where, ("arrived_at", "num_prefill_tokens", "num_decode_tokens"))
        i_t, i_in, i_out = (rows.columns[c] for c in ("arrived_at", "num_prefill_tokens", "num_decode_tokens"))
        extras = _optional_extras(rows)
        acc = _Rows()
        for index, (line, row) in enumerate(rows):
            arrival = _parse_float(row[i_t], where, line, "arrived_at")
            prompt = _parse_tokens(row[i_in], where, line, "num_prefill_tokens")
            output = _parse_tokens(row[i_out], where, line, "num_decode_tokens")
            acc.add(index, arrival, prompt, output, *extras(line, row))
    return acc.to_trace(name or _default_name(path), prefix or _default_prefix(path), cap)


def load_mooncake(path: PathLike, *, name: str | None = None, prefix: str | None = None,
                  max_tokens_default: int = DEFAULT_MAX_TOKENS) -> Trace:
    """Load a Mooncake JSONL trace: one object per line with `timestamp` (ms), `input_length`,
    `output_length` (`hash_ids` and other keys are ignored). Blank lines are passed over. The
    format records no client cap: every request gets `max_tokens_default`."""
    cap = _check_cap(max_tokens_default)
    where = os.fspath(path)
    acc = _Rows()
    with _open(path) as f:
        index = 0
        try:
            for line, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise TraceError(f"{where}:{line}: invalid JSON: {e.msg} (char {e.colno})") from None
                if not isinstance(obj, dict):
                    raise TraceError(f"{where}:{line}: expected a JSON object, got {type(obj).__name__}")
                ts = _json_number(obj, "timestamp", where, line)
                prompt = _json_tokens(obj, "input_length", where, line)
                output = _json_tokens(obj, "output_length", where, line)
                acc.add(index, ts / 1000.0, prompt, output)
                index += 1
        except UnicodeDecodeError as e:
            raise TraceError(f"{where}: not UTF-8 text: {e}") from None
    return acc.to_trace(name or _default_name(path), prefix or _default_prefix(path), cap)


def _json_number(obj: dict, key: str, where: str, line: int) -> float:
    if key not in obj:
        raise TraceError(f"{where}:{line}: missing field {key!r}")
    v = obj[key]
    # bool is an int subclass; a `true` timestamp is a data error, not 1 ms.
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise _err(where, line, key, f"{v!r} is not a finite number")
    return float(v)


def _json_tokens(obj: dict, key: str, where: str, line: int) -> int:
    v = _json_number(obj, key, where, line)
    if not v.is_integer():
        raise _err(where, line, key, f"{obj[key]!r} is not an integer token count")
    if v < 1:
        raise _err(where, line, key, f"token count must be >= 1, got {obj[key]!r}")
    return int(v)


def load_burstgpt(
    path: PathLike, *, name: str | None = None, prefix: str | None = None, tenant_column: str | None = None,
    max_tokens_default: int = DEFAULT_MAX_TOKENS,
) -> Trace:
    """Load a BurstGPT CSV (`Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`).

    `Timestamp` is in seconds. Rows with 0 `Response tokens` are failed requests: they are skipped
    by design and counted in `trace.skipped` (ids keep the file row index, so gaps show where).
    A completed row (response > 0) with 0 `Request tokens` is an error. `tenant_column` (e.g.
    "Model" or "Log Type") copies that column into `tenant`; by default every request is tenant
    "default", type "chat". The format records no client cap: every request gets
    `max_tokens_default`.
    """
    cap = _check_cap(max_tokens_default)
    where = os.fspath(path)
    required = ["Timestamp", "Request tokens", "Response tokens"]
    if tenant_column is not None:
        required.append(tenant_column)
    with _open(path) as f:
        rows = _CsvRows(f, where, required)
        i_t, i_in, i_out = (rows.columns[c] for c in ("Timestamp", "Request tokens", "Response tokens"))
        i_tenant = rows.columns[tenant_column] if tenant_column is not None else None
        acc = _Rows()
        skipped = 0
        for index, (line, row) in enumerate(rows):
            arrival = _parse_float(row[i_t], where, line, "Timestamp")
            prompt = _parse_tokens(row[i_in], where, line, "Request tokens", minimum=0)
            output = _parse_tokens(row[i_out], where, line, "Response tokens", minimum=0)
            if output == 0:
                skipped += 1  # a failed request: BurstGPT logs failures with 0 response tokens
                continue
            if prompt == 0:
                raise _err(where, line, "Request tokens", "token count must be >= 1 for a completed request, got 0")
            tenant = "default"
            if i_tenant is not None:
                tenant = row[i_tenant].strip()
                if not tenant:
                    raise _err(where, line, tenant_column or "", "empty tenant value")
            acc.add(index, arrival, prompt, output, None, tenant)
    return acc.to_trace(name or _default_name(path), prefix or _default_prefix(path), cap, skipped=skipped)


def load_lengths(
    path: PathLike,
    *,
    rate: float,
    process: ArrivalProcess = "poisson",
    cv: float = 1.0,
    seed: int = 0,
    n: int | None = None,
    name: str | None = None,
    prefix: str | None = None,
    max_tokens_default: int = DEFAULT_MAX_TOKENS,
) -> Trace:
    """Load a length-only CSV (`num_prefill_tokens,num_decode_tokens,...`) and attach generated
    arrivals (`generate_arrivals`: Poisson at `rate`, or Gamma inter-arrivals with CV `cv`).

    `n` takes the first n rows (asking for more rows than the file has is an error). Optional
    columns `max_tokens`, `tenant`, `type` are read as in `load_vidur` (rows without a
    `max_tokens` get `max_tokens_default`).
    """
    if n is not None and n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    cap = _check_cap(max_tokens_default)
    where = os.fspath(path)
    with _open(path) as f:
        rows = _CsvRows(f, where, ("num_prefill_tokens", "num_decode_tokens"))
        i_in, i_out = rows.columns["num_prefill_tokens"], rows.columns["num_decode_tokens"]
        extras = _optional_extras(rows)
        acc = _Rows()
        for index, (line, row) in enumerate(rows):
            if n is not None and index >= n:
                break
            prompt = _parse_tokens(row[i_in], where, line, "num_prefill_tokens")
            output = _parse_tokens(row[i_out], where, line, "num_decode_tokens")
            acc.add(index, 0.0, prompt, output, *extras(line, row))
    if n is not None and len(acc.index) < n:
        raise TraceError(f"{where}: n={n} requested but the file has only {len(acc.index)} rows")
    acc.arrival = generate_arrivals(len(acc.index), rate=rate, process=process, cv=cv, seed=seed).tolist()
    return acc.to_trace(name or _default_name(path), prefix or _default_prefix(path), cap)


def load_servegen_reasoning(
    path: PathLike,
    *,
    n: int,
    rate: float,
    process: ArrivalProcess = "poisson",
    cv: float = 1.0,
    seed: int = 0,
    model: str | None = None,
    name: str | None = None,
    prefix: str = "reasoning",
    max_tokens_default: int = DEFAULT_MAX_TOKENS,
) -> Trace:
    """Sample `n` reasoning requests from a ServeGen length-PMF CSV (`model,field,value,prob`).

    Input and output lengths are drawn independently from the `input_tokens` and `output_tokens`
    marginals (ServeGen's own sampler makes the same independence assumption; the file carries no
    joint distribution). Other fields (`reason_ratio`) are not used. Each field's probabilities
    must sum to 1 within 1e-4 (the file rounds them to 6 significant digits) and are renormalized.
    If the file holds several models, `model` selects one. Arrivals come from `generate_arrivals`.
    Every request gets the cap `max_tokens_default`; a drawn output longer than it is truncated to
    it (reasoning outputs often are: raise the cap to keep their long tail).
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    cap = _check_cap(max_tokens_default)
    where = os.fspath(path)
    pmf: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    with _open(path) as f:
        rows = _CsvRows(f, where, ("model", "field", "value", "prob"))
        i_model, i_field, i_value, i_prob = (rows.columns[c] for c in ("model", "field", "value", "prob"))
        for line, row in rows:
            field = row[i_field].strip()
            if field not in ("input_tokens", "output_tokens"):
                continue  # other marginals (reason_ratio) are not request lengths
            value = _parse_tokens(row[i_value], where, line, "value")
            prob = _parse_float(row[i_prob], where, line, "prob")
            if prob < 0.0:
                raise _err(where, line, "prob", f"probability must be >= 0, got {prob}")
            values, probs = pmf.setdefault(row[i_model].strip(), {}).setdefault(field, ([], []))
            values.append(value)
            probs.append(prob)
    if not pmf:
        raise TraceError(f"{where}: no input_tokens/output_tokens rows")
    if model is None:
        if len(pmf) > 1:
            raise TraceError(f"{where}: the file holds several models {sorted(pmf)}; pass model=")
        model = next(iter(pmf))
    if model not in pmf:
        raise TraceError(f"{where}: model {model!r} not in the file (models: {sorted(pmf)})")
    marginals = []
    for field in ("input_tokens", "output_tokens"):
        if field not in pmf[model]:
            raise TraceError(f"{where}: model {model!r} has no {field!r} rows")
        values, probs = pmf[model][field]
        total = math.fsum(probs)
        if abs(total - 1.0) > 1e-4:
            raise TraceError(f"{where}: {model} {field} probabilities sum to {total:.6g}, expected 1")
        marginals.append((np.asarray(values, dtype=np.int64), np.asarray(probs) / total))

    rng = np.random.default_rng(seed)
    (in_values, in_p), (out_values, out_p) = marginals
    prompts = rng.choice(in_values, size=n, p=in_p)
    outputs = rng.choice(out_values, size=n, p=out_p)
    arrivals = generate_arrivals(n, rate=rate, process=process, cv=cv, seed=rng)
    ids = _ids(prefix, range(n))
    requests = tuple(
        _request(rid, float(a), int(p), int(o), None, cap, type="reasoning")
        for rid, a, p, o in zip(ids, arrivals, prompts, outputs)
    )
    return Trace(name or f"servegen-{model}", requests)


def generate_arrivals(
    n: int,
    *,
    rate: float,
    process: ArrivalProcess = "poisson",
    cv: float = 1.0,
    seed: int | np.random.Generator = 0,
) -> np.ndarray:
    """`n` arrival times starting at 0.0, with mean inter-arrival gap 1/rate.

    "poisson": exponential gaps (CV 1; passing another `cv` is an error). "gamma": Gamma gaps with
    shape 1/cv**2 and scale cv**2/rate, so the gaps' coefficient of variation is `cv` (cv > 1 is
    burstier than Poisson, cv < 1 smoother; cv = 1 is Poisson).
    """
    if not (math.isfinite(rate) and rate > 0.0):
        raise ValueError(f"rate must be a finite positive req/s, got {rate}")
    if not (math.isfinite(cv) and cv > 0.0):
        raise ValueError(f"cv must be finite and > 0, got {cv}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    if process == "poisson":
        if cv != 1.0:
            raise ValueError(f"cv={cv} only applies to process='gamma' (Poisson arrivals have CV 1)")
        gaps = rng.exponential(1.0 / rate, size=max(n - 1, 0))
    elif process == "gamma":
        shape = 1.0 / (cv * cv)
        gaps = rng.gamma(shape, 1.0 / (rate * shape), size=max(n - 1, 0))
    else:
        raise ValueError(f"process must be 'poisson' or 'gamma', got {process!r}")
    return np.concatenate(([0.0], np.cumsum(gaps)))[:n]


def load_trace(path: PathLike, **kw) -> Trace:
    """Load any supported trace, choosing the loader from the file's content.

    JSONL (`.jsonl`, or a first line starting with "{") -> Mooncake. CSVs by header: Azure
    (`TIMESTAMP,ContextTokens,GeneratedTokens`), vidur (`arrived_at,...`), length-only
    (`num_prefill_tokens,num_decode_tokens` without `arrived_at`; needs `rate=`), BurstGPT
    (`Timestamp,...,Request tokens,Response tokens`), ServeGen PMF (`model,field,value,prob`; needs
    `n=` and `rate=`). Keyword arguments go to the chosen loader; every loader takes
    `max_tokens_default=` (the cap of requests whose source records none).
    """
    where = os.fspath(path)
    loader, first = _choose_loader(path, where, kw)
    # Arrival-generation settings (rate, process, cv, seed, n) only reach loaders that take them,
    # so one command line can name any trace file.
    accepted = inspect.signature(loader).parameters
    return loader(path, **{k: v for k, v in kw.items() if k in accepted or k not in _GENERATION_KEYS})


_GENERATION_KEYS = {"rate", "process", "cv", "seed", "n"}


def _choose_loader(path: PathLike, where: str, kw: dict):
    with _open(path) as f:
        try:
            first = next((line for line in f if line.strip()), "")
        except UnicodeDecodeError as e:
            raise TraceError(f"{where}: not UTF-8 text: {e}") from None
    if where.endswith(".jsonl") or first.lstrip().startswith("{"):
        return load_mooncake, first
    header = {c.strip() for c in next(csv.reader([first]), [])}
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= header:
        return load_azure, first
    if {"arrived_at", "num_prefill_tokens", "num_decode_tokens"} <= header:
        return load_vidur, first
    if {"num_prefill_tokens", "num_decode_tokens"} <= header:
        if "rate" not in kw:
            raise ArrivalsNeeded(f"{where}: a length-only trace (no arrival times): pass rate= "
                                 "(and optionally process=, cv=, seed=, n=)", ("rate",))
        return load_lengths, first
    if {"Timestamp", "Request tokens", "Response tokens"} <= header:
        return load_burstgpt, first
    if {"model", "field", "value", "prob"} <= header:
        if "rate" not in kw or "n" not in kw:
            raise ArrivalsNeeded(f"{where}: a length distribution (no requests): pass n= and rate=", ("n", "rate"))
        return load_servegen_reasoning, first
    raise TraceError(f"{where}: unknown trace format; header seen: {first.strip()[:200]!r}")


def bundled_trace_path() -> Path:
    """Path of the bundled Azure conv window (first 600 s of AzureLLMInferenceTrace_conv.csv)."""
    ref = resources.files("sim").joinpath("data", BUNDLED_FILE)
    if not isinstance(ref, Path):  # e.g. a zipped install: no real file to point at
        raise TraceError(f"{BUNDLED_FILE}: the package is not installed as files; use load_bundled()")
    return ref


def load_bundled(*, max_tokens_default: int = DEFAULT_MAX_TOKENS) -> Trace:
    """The bundled Azure conv window as a Trace (name "azure-conv-window", ids "conv-NNNNNN").

    Every request gets the cap `max_tokens_default` (the format records none; the window's
    longest output is 1,000 tokens, so the default 4,096 truncates nothing).

    Data: Azure/AzurePublicDataset, AzureLLMInferenceTrace_conv.csv, CC BY 4.0 (Patel et al.,
    "Splitwise", ISCA 2024).
    """
    cap = _check_cap(max_tokens_default)
    ref = resources.files("sim").joinpath("data", BUNDLED_FILE)
    # Read through the Traversable so this works even when the package is not on a filesystem.
    with ref.open("r", newline="", encoding="utf-8-sig") as f:  # type: ignore[call-overload]  # stub lacks newline=
        return _parse_azure(f, BUNDLED_FILE, "azure-conv-window", "conv", cap)


# --------------------------------------------------------------------------------------------
# Transforms: pure functions returning new Traces
# --------------------------------------------------------------------------------------------


def _rebuild(trace: Trace, requests: Iterable[TraceRequest], suffix: str) -> Trace:
    return Trace(f"{trace.name}|{suffix}", tuple(requests), trace.skipped)


def scale_rate(trace: Trace, factor: float) -> Trace:
    """Multiply the arrival rate by `factor` (arrivals divided by it); lengths are unchanged."""
    if not (math.isfinite(factor) and factor > 0.0):
        raise ValueError(f"factor must be finite and > 0, got {factor}")
    return _rebuild(trace, (dataclasses.replace(r, arrival=r.arrival / factor) for r in trace), f"rate*{factor:g}")


def target_rate(trace: Trace, rps: float) -> Trace:
    """Rescale time so the mean rate (`Trace.rate`) becomes `rps` req/s."""
    if not (math.isfinite(rps) and rps > 0.0):
        raise ValueError(f"rps must be finite and > 0, got {rps}")
    current = trace.rate
    if not (math.isfinite(current) and current > 0.0):
        raise ValueError(f"trace {trace.name!r} has no finite positive rate ({current}); cannot retarget it")
    return scale_rate(trace, rps / current)


def time_window(trace: Trace, start_s: float, duration_s: float) -> Trace:
    """Requests arriving in [start_s, start_s + duration_s), re-zeroed so the first is at 0.0.

    An empty window gives an empty trace.
    """
    if not (math.isfinite(start_s) and math.isfinite(duration_s) and duration_s > 0.0):
        raise ValueError(f"need finite start_s and duration_s > 0, got {start_s}, {duration_s}")
    end = start_s + duration_s
    kept = [r for r in trace if start_s <= r.arrival < end]
    t0 = kept[0].arrival if kept else 0.0
    return _rebuild(trace, (dataclasses.replace(r, arrival=r.arrival - t0) for r in kept),
                    f"window[{start_s:g}s+{duration_s:g}s]")


def cap_max_tokens(trace: Trace, cap: int) -> Trace:
    """Clamp `max_tokens` and the true `output_tokens` to `cap` (a server-side max_tokens limit).

    A request whose output was longer than `cap` is flagged `truncated` (and counted in
    `Trace.truncated`)."""
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"cap must be an integer >= 1, got {cap!r}")
    return _rebuild(
        trace,
        (dataclasses.replace(r, max_tokens=min(r.max_tokens, cap), output_tokens=min(r.output_tokens, cap),
                             truncated=r.truncated or r.output_tokens > cap)
         for r in trace),
        f"cap{cap}",
    )


def transform(trace: Trace, *, window: tuple[float, float] | None = None, rate_scale: float | None = None,
              rate: float | None = None, max_tokens_cap: int | None = None, tenants: int | None = None,
              seed: int = 0) -> Trace:
    """The command line's transforms, in their one order: time window, rate scale, target rate,
    max_tokens cap, Zipf tenants (each skipped when None).

    The cap of requests whose source records none (--max-tokens-default) is not a transform: only
    a loader knows which requests had no cap, so it is the loaders' `max_tokens_default=`."""
    if window is not None:
        trace = time_window(trace, *window)
    if rate_scale is not None:
        trace = scale_rate(trace, rate_scale)
    if rate is not None:
        trace = target_rate(trace, rate)
    if max_tokens_cap is not None:
        trace = cap_max_tokens(trace, max_tokens_cap)
    if tenants:
        trace = assign_tenants_zipf(trace, tenants, seed=seed)
    return trace


def scale_tokens(trace: Trace, prompt_factor: float = 1.0, output_factor: float = 1.0) -> Trace:
    """Scale prompt and output lengths (rounded to nearest, at least 1 token).

    `max_tokens` (the client's cap, the same for every request of a source without caps) scales
    with `output_factor` too, so outputs stay within their caps and a truncated request stays at
    its cap.
    """
    for label, f in (("prompt_factor", prompt_factor), ("output_factor", output_factor)):
        if not (math.isfinite(f) and f > 0.0):
            raise ValueError(f"{label} must be finite and > 0, got {f}")

    def scaled(x: int, f: float) -> int:
        return max(1, round(x * f))

    return _rebuild(
        trace,
        (dataclasses.replace(r, prompt_tokens=scaled(r.prompt_tokens, prompt_factor),
                             output_tokens=scaled(r.output_tokens, output_factor),
                             max_tokens=scaled(r.max_tokens, output_factor))
         for r in trace),
        f"tokens*({prompt_factor:g},{output_factor:g})",
    )


def assign_tenants_zipf(trace: Trace, n_tenants: int, s: float = 1.1, seed: int = 0) -> Trace:
    """Assign tenants "t0".."t{n-1}" independently per request with Zipf(s) popularity:
    P(t_k) proportional to 1/(k+1)**s, so t0 is the most popular (s = 0 is uniform)."""
    if n_tenants < 1:
        raise ValueError(f"n_tenants must be >= 1, got {n_tenants}")
    if not (math.isfinite(s) and s >= 0.0):
        raise ValueError(f"s must be finite and >= 0, got {s}")
    weights = 1.0 / np.arange(1, n_tenants + 1, dtype=np.float64) ** s
    picks = np.random.default_rng(seed).choice(n_tenants, size=len(trace), p=weights / weights.sum())
    return _rebuild(trace, (dataclasses.replace(r, tenant=f"t{k}") for r, k in zip(trace, picks.tolist())),
                    f"zipf{n_tenants}(s={s:g})")


def assign_tenants_from(trace: Trace, mapping_fn: Callable[[TraceRequest], str]) -> Trace:
    """Set each request's tenant to `mapping_fn(request)` (a non-empty string)."""

    def tenant_of(r: TraceRequest) -> str:
        tenant = mapping_fn(r)
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"mapping_fn returned {tenant!r} for request {r.id!r}; expected a non-empty str")
        return tenant

    return _rebuild(trace, (dataclasses.replace(r, tenant=tenant_of(r)) for r in trace), "tenants")


def with_type(trace: Trace, type: str) -> Trace:
    """Set every request's type (one of REQUEST_TYPES)."""
    if type not in REQUEST_TYPES:
        raise ValueError(f"type must be one of {sorted(REQUEST_TYPES)}, got {type!r}")
    return _rebuild(trace, (dataclasses.replace(r, type=type) for r in trace), type)


def mix(
    parts: Sequence[tuple[Trace, float]],
    *,
    n: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
    name: str | None = None,
) -> Trace:
    """Mix traces by fraction, on the arrival times of the first part's trace.

    Arrival slots are the first trace's arrivals (the first `n`, and/or those before
    `duration_s`). If more slots are asked for than the first trace has, the arrivals are
    continued past its last one with a Poisson process at its mean rate. Each slot independently
    draws a part with probability `fraction_i` (seeded) and takes that part's lengths, tenant and
    type. The first part supplies its own request at that slot, so real arrival/length pairs are
    kept (continued slots cycle from its start); other parts supply requests in a seeded random
    order without replacement, reshuffled when exhausted. Ids are `<slot>-<source id>`, unique.
    Fractions must be >= 0 and sum to 1 within 1e-9, else ValueError.
    """
    if not parts:
        raise ValueError("mix needs at least one (trace, fraction) part")
    fractions = [float(f) for _, f in parts]
    total = math.fsum(fractions)
    if any(not math.isfinite(f) or f < 0.0 for f in fractions) or abs(total - 1.0) > 1e-9:
        raise ValueError(f"mix fractions must be >= 0 and sum to 1 (within 1e-9); got {fractions}, sum {total!r}")
    for trace, f in parts:
        if f > 0.0 and len(trace) == 0:
            raise ValueError(f"mix part {trace.name!r} has fraction {f} but no requests")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if duration_s is not None and not duration_s > 0.0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")

    rng = np.random.default_rng(seed)
    base = parts[0][0]
    slots = _mix_slots(base, n, duration_s, rng)
    choice = rng.choice(len(parts), size=len(slots), p=np.asarray(fractions) / total)

    # Per-part draw order for parts other than the first: shuffled, without replacement.
    orders: dict[int, list[int]] = {}
    cursors: dict[int, int] = {}
    requests: list[TraceRequest] = []
    width = max(6, len(str(max(len(slots) - 1, 0))))
    for j, (arrival, part) in enumerate(zip(slots.tolist(), choice.tolist())):
        source = parts[part][0]
        if part == 0:
            src = source.requests[j % len(source)]
        else:
            k = cursors.get(part, 0)
            if k % len(source) == 0:
                orders[part] = rng.permutation(len(source)).tolist()
            src = source.requests[orders[part][k % len(source)]]
            cursors[part] = k + 1
        requests.append(dataclasses.replace(src, id=f"{j:0{width}d}-{src.id}", arrival=arrival))
    if name is None:
        name = "mix(" + "+".join(f"{f:g}*{t.name}" for t, f in parts) + ")"
    return Trace(name, tuple(requests))


def _mix_slots(base: Trace, n: int | None, duration_s: float | None, rng: np.random.Generator) -> np.ndarray:
    arrivals = base.arrivals()
    if n is None and duration_s is None:
        return arrivals
    need_more = (n is not None and n > len(arrivals)) or (
        duration_s is not None and n is None and (len(arrivals) == 0 or arrivals[-1] < duration_s)
    )
    if need_more:
        rate = base.rate
        if not (math.isfinite(rate) and rate > 0.0):
            raise ValueError(f"mix: the first trace {base.name!r} has too few arrivals and no usable rate ({rate})")
        last = arrivals[-1]
        extra: list[np.ndarray] = []
        while True:  # continue with Poisson arrivals until n / duration_s is covered
            gaps = rng.exponential(1.0 / rate, size=max(1024, (n or 0) - len(arrivals)))
            chunk = last + np.cumsum(gaps)
            extra.append(chunk)
            last = chunk[-1]
            total = len(arrivals) + sum(len(c) for c in extra)
            if (n is None or total >= n) and (duration_s is None or n is not None or last >= duration_s):
                break
        arrivals = np.concatenate([arrivals, *extra])
    if duration_s is not None:
        arrivals = arrivals[arrivals < duration_s]
    if n is not None:
        arrivals = arrivals[:n]
    return arrivals
