"""Trace loaders, one per supported format (the list is in the package docstring, `sim.traces`),
`load_trace`, which picks one from a file's content, and the bundled Azure conv window
(`bundled_trace_path`, `load_bundled`).

Every loader re-zeroes arrivals, gives ids `<prefix>-<row index>`, takes `max_tokens_default=`
(the cap of requests whose source records none) and reports bad input as a `TraceError`.
"""

from __future__ import annotations

import csv
import inspect
import json
import math
import os
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import IO, Any

import numpy as np

from scheduler.names import DEFAULT_TENANT, DEFAULT_TYPE
from sim.traces.arrivals import ArrivalProcess, generate_arrivals
from sim.traces.model import DEFAULT_MAX_TOKENS, Trace, TraceError
from sim.traces.parsing import (
    AZURE_TICKS_PER_S,
    AzureClock,
    CsvRows,
    ParsedRows,
    PathLike,
    field_error,
    open_trace_file,
    parse_float,
    parse_tokens,
    parse_type,
    request_ids,
    source_request,
)

#: The bundled window's file name in the package's data folder (sim/data).
BUNDLED_FILE = "azure_conv_window.csv"


class ArrivalsNeeded(TraceError):
    """The file has lengths but no arrival times; ``needs`` names the generation arguments it
    takes (``("rate",)`` for length-only CSVs, ``("n", "rate")`` for a length distribution)."""

    def __init__(self, message: str, needs: tuple[str, ...]) -> None:
        super().__init__(message)
        self.needs = needs


# --------------------------------------------------------------------------------------------
# Pieces the loaders share
# --------------------------------------------------------------------------------------------


def _default_name(path: PathLike) -> str:
    stem = Path(os.fspath(path)).stem
    if stem.startswith("AzureLLMInferenceTrace_"):
        return "azure-" + stem.removeprefix("AzureLLMInferenceTrace_")
    return stem


def _default_prefix(path: PathLike) -> str:
    stem = Path(os.fspath(path)).stem
    return stem.removeprefix("AzureLLMInferenceTrace_")


def _check_cap(value: int, label: str = "max_tokens_default") -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"{label} must be an integer >= 1, got {value!r}")
    return int(value)


def _optional_extras(rows: CsvRows) -> Callable[[int, list[str]], tuple[int | None, str, str]]:
    """Reader for the optional `max_tokens`, `tenant` and `type` columns of vidur/lengths CSVs."""
    where, cols = rows.where, rows.columns
    i_max, i_tenant, i_type = cols.get("max_tokens"), cols.get("tenant"), cols.get("type")

    def extras(line: int, row: list[str]) -> tuple[int | None, str, str]:
        max_tokens = None
        if i_max is not None and row[i_max].strip():
            max_tokens = parse_tokens(row[i_max], where, line, "max_tokens")
        tenant = row[i_tenant].strip() if i_tenant is not None else ""
        typ = parse_type(row[i_type], where, line, "type") if i_type is not None else DEFAULT_TYPE
        return max_tokens, tenant or DEFAULT_TENANT, typ

    return extras


# --------------------------------------------------------------------------------------------
# Loaders, one per format
# --------------------------------------------------------------------------------------------


def load_azure(
    path: PathLike,
    *,
    name: str | None = None,
    prefix: str | None = None,
    max_tokens_default: int = DEFAULT_MAX_TOKENS,
) -> Trace:
    """Load an Azure LLM inference 2023 CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`).

    Timestamps are parsed exactly to 100 ns (integer ticks, then one division), so arrivals are
    the correctly rounded float of the true offset. The format is sorted by time: a timestamp
    earlier than the previous row's is an error (equal ones are accepted). The format records no
    client cap: every request gets `max_tokens_default` (longer outputs are truncated to it).
    """
    cap = _check_cap(max_tokens_default)
    where = os.fspath(path)
    with open_trace_file(path) as f:
        return _parse_azure(
            f, where, name or _default_name(path), prefix or _default_prefix(path), cap
        )


def _parse_azure(f: IO[str], where: str, name: str, prefix: str, cap: int) -> Trace:
    rows = CsvRows(f, where, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    i_ts, i_in, i_out = (rows.columns[c] for c in ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    clock = AzureClock()
    ticks: list[int] = []
    prompt: list[int] = []
    output: list[int] = []
    for line, row in rows:
        t = clock.ticks(row[i_ts], where, line, "TIMESTAMP")
        if ticks and t < ticks[-1]:
            what = (
                f"{row[i_ts].strip()!r} is earlier than the previous row's "
                "(the format is sorted by time)"
            )
            raise field_error(where, line, "TIMESTAMP", what)
        ticks.append(t)
        prompt.append(parse_tokens(row[i_in], where, line, "ContextTokens"))
        output.append(parse_tokens(row[i_out], where, line, "GeneratedTokens"))
    t0 = ticks[0] if ticks else 0
    ids = request_ids(prefix, range(len(ticks)))
    # int / int true division is correctly rounded: arrival = nearest float to the exact offset.
    requests = tuple(
        source_request(rid, (t - t0) / AZURE_TICKS_PER_S, p, o, None, cap)
        for rid, t, p, o in zip(ids, ticks, prompt, output)
    )
    return Trace(name, requests)


def load_vidur(
    path: PathLike,
    *,
    name: str | None = None,
    prefix: str | None = None,
    max_tokens_default: int = DEFAULT_MAX_TOKENS,
) -> Trace:
    """Load a vidur trace CSV (`arrived_at,num_prefill_tokens,num_decode_tokens`, seconds).

    Optional columns: `max_tokens`, `tenant`, `type` (empty cells mean "default"/"chat"/no cap).
    A recorded `max_tokens` is kept; a row without one gets `max_tokens_default`. Rows need not be
    sorted; the trace is sorted and re-zeroed.
    """
    cap = _check_cap(max_tokens_default)
    where = os.fspath(path)
    with open_trace_file(path) as f:
        rows = CsvRows(f, where, ("arrived_at", "num_prefill_tokens", "num_decode_tokens"))
        i_t, i_in, i_out = (
            rows.columns[c] for c in ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
        )
        extras = _optional_extras(rows)
        acc = ParsedRows()
        for index, (line, row) in enumerate(rows):
            arrival = parse_float(row[i_t], where, line, "arrived_at")
            prompt = parse_tokens(row[i_in], where, line, "num_prefill_tokens")
            output = parse_tokens(row[i_out], where, line, "num_decode_tokens")
            acc.add(index, arrival, prompt, output, *extras(line, row))
    return acc.to_trace(name or _default_name(path), prefix or _default_prefix(path), cap)


def load_mooncake(
    path: PathLike,
    *,
    name: str | None = None,
    prefix: str | None = None,
    max_tokens_default: int = DEFAULT_MAX_TOKENS,
) -> Trace:
    """Load a Mooncake JSONL trace: one object per line with `timestamp` (ms), `input_length`,
    `output_length` (`hash_ids` and other keys are ignored). Blank lines are passed over. The
    format records no client cap: every request gets `max_tokens_default`."""
    cap = _check_cap(max_tokens_default)
    where = os.fspath(path)
    acc = ParsedRows()
    with open_trace_file(path) as f:
        index = 0
        try:
            for line, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise TraceError(
                        f"{where}:{line}: invalid JSON: {e.msg} (char {e.colno})"
                    ) from None
                except ValueError:  # an integer over Python's 4,300-digit limit
                    raise TraceError(
                        f"{where}:{line}: invalid JSON: a number of more than 4,300 digits"
                    ) from None
                if not isinstance(obj, dict):
                    raise TraceError(
                        f"{where}:{line}: expected a JSON object, got {type(obj).__name__}"
                    )
                ts = _json_number(obj, "timestamp", where, line)
                prompt = _json_tokens(obj, "input_length", where, line)
                output = _json_tokens(obj, "output_length", where, line)
                acc.add(index, ts / 1000.0, prompt, output)
                index += 1
        except UnicodeDecodeError as e:
            raise TraceError(f"{where}: not UTF-8 text: {e}") from None
    return acc.to_trace(name or _default_name(path), prefix or _default_prefix(path), cap)


def _json_number(obj: dict[str, Any], key: str, where: str, line: int) -> float:
    if key not in obj:
        raise TraceError(f"{where}:{line}: missing field {key!r}")
    v = obj[key]
    # bool is an int subclass; a `true` timestamp is a data error, not 1 ms.
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise field_error(where, line, key, f"{v!r} is not a finite number")
    try:
        as_float = float(v)  # an integer past a float's range raises
    except OverflowError:
        as_float = math.inf
    if not math.isfinite(as_float):
        raise field_error(where, line, key, f"{str(v)[:40]} is not a finite number")
    return as_float


def _json_tokens(obj: dict[str, Any], key: str, where: str, line: int) -> int:
    v = _json_number(obj, key, where, line)
    if not v.is_integer():
        raise field_error(where, line, key, f"{obj[key]!r} is not an integer token count")
    if v < 1:
        raise field_error(where, line, key, f"token count must be >= 1, got {obj[key]!r}")
    return int(v)


def load_burstgpt(
    path: PathLike,
    *,
    name: str | None = None,
    prefix: str | None = None,
    tenant_column: str | None = None,
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
    with open_trace_file(path) as f:
        rows = CsvRows(f, where, required)
        i_t, i_in, i_out = (
            rows.columns[c] for c in ("Timestamp", "Request tokens", "Response tokens")
        )
        i_tenant = rows.columns[tenant_column] if tenant_column is not None else None
        acc = ParsedRows()
        skipped = 0
        for index, (line, row) in enumerate(rows):
            arrival = parse_float(row[i_t], where, line, "Timestamp")
            prompt = parse_tokens(row[i_in], where, line, "Request tokens", minimum=0)
            output = parse_tokens(row[i_out], where, line, "Response tokens", minimum=0)
            if output == 0:
                skipped += 1  # a failed request: BurstGPT logs failures with 0 response tokens
                continue
            if prompt == 0:
                raise field_error(
                    where,
                    line,
                    "Request tokens",
                    "token count must be >= 1 for a completed request, got 0",
                )
            tenant = DEFAULT_TENANT
            if i_tenant is not None:
                tenant = row[i_tenant].strip()
                if not tenant:
                    raise field_error(where, line, tenant_column or "", "empty tenant value")
            acc.add(index, arrival, prompt, output, None, tenant)
    return acc.to_trace(
        name or _default_name(path), prefix or _default_prefix(path), cap, skipped=skipped
    )


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
    with open_trace_file(path) as f:
        rows = CsvRows(f, where, ("num_prefill_tokens", "num_decode_tokens"))
        i_in, i_out = rows.columns["num_prefill_tokens"], rows.columns["num_decode_tokens"]
        extras = _optional_extras(rows)
        acc = ParsedRows()
        for index, (line, row) in enumerate(rows):
            if n is not None and index >= n:
                break
            prompt = parse_tokens(row[i_in], where, line, "num_prefill_tokens")
            output = parse_tokens(row[i_out], where, line, "num_decode_tokens")
            acc.add(index, 0.0, prompt, output, *extras(line, row))
    if n is not None and len(acc.index) < n:
        raise TraceError(f"{where}: n={n} requested but the file has only {len(acc.index)} rows")
    acc.arrival = generate_arrivals(
        len(acc.index), rate=rate, process=process, cv=cv, seed=seed
    ).tolist()
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
    with open_trace_file(path) as f:
        rows = CsvRows(f, where, ("model", "field", "value", "prob"))
        i_model, i_field, i_value, i_prob = (
            rows.columns[c] for c in ("model", "field", "value", "prob")
        )
        for line, row in rows:
            field = row[i_field].strip()
            if field not in ("input_tokens", "output_tokens"):
                continue  # other marginals (reason_ratio) are not request lengths
            value = parse_tokens(row[i_value], where, line, "value")
            prob = parse_float(row[i_prob], where, line, "prob")
            if prob < 0.0:
                raise field_error(where, line, "prob", f"probability must be >= 0, got {prob}")
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
            raise TraceError(
                f"{where}: {model} {field} probabilities sum to {total:.6g}, expected 1"
            )
        marginals.append((np.asarray(values, dtype=np.int64), np.asarray(probs) / total))

    rng = np.random.default_rng(seed)
    (in_values, in_p), (out_values, out_p) = marginals
    prompts = rng.choice(in_values, size=n, p=in_p)
    outputs = rng.choice(out_values, size=n, p=out_p)
    arrivals = generate_arrivals(n, rate=rate, process=process, cv=cv, seed=rng)
    ids = request_ids(prefix, range(n))
    requests = tuple(
        source_request(rid, float(a), int(p), int(o), None, cap, type="reasoning")
        for rid, a, p, o in zip(ids, arrivals, prompts, outputs)
    )
    return Trace(name or f"servegen-{model}", requests)


# --------------------------------------------------------------------------------------------
# Format detection and the bundled window
# --------------------------------------------------------------------------------------------


def load_trace(path: PathLike, **kw: Any) -> Trace:
    """Load any supported trace, choosing the loader from the file's content.

    JSONL (`.jsonl`, or a first line starting with "{") -> Mooncake. CSVs by header: Azure
    (`TIMESTAMP,ContextTokens,GeneratedTokens`), vidur (`arrived_at,...`), length-only
    (`num_prefill_tokens,num_decode_tokens` without `arrived_at`; needs `rate=`), BurstGPT
    (`Timestamp,...,Request tokens,Response tokens`), ServeGen PMF (`model,field,value,prob`; needs
    `n=` and `rate=`). Keyword arguments go to the chosen loader; every loader takes
    `max_tokens_default=` (the cap of requests whose source records none).
    """
    where = os.fspath(path)
    loader = _choose_loader(path, where, kw)
    # Arrival-generation settings (rate, process, cv, seed, n) only reach loaders that take them,
    # so one command line can name any trace file.
    accepted = inspect.signature(loader).parameters
    return loader(
        path, **{k: v for k, v in kw.items() if k in accepted or k not in _GENERATION_KEYS}
    )


_GENERATION_KEYS = {"rate", "process", "cv", "seed", "n"}


def _choose_loader(path: PathLike, where: str, kw: dict[str, Any]) -> Callable[..., Trace]:
    """The loader for the file's format, from its first non-blank line."""
    with open_trace_file(path) as f:
        try:
            first = next((line for line in f if line.strip()), "")
        except UnicodeDecodeError as e:
            raise TraceError(f"{where}: not UTF-8 text: {e}") from None
    if where.endswith(".jsonl") or first.lstrip().startswith("{"):
        return load_mooncake
    header = {c.strip() for c in next(csv.reader([first]), [])}
    if {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= header:
        return load_azure
    if {"arrived_at", "num_prefill_tokens", "num_decode_tokens"} <= header:
        return load_vidur
    if {"num_prefill_tokens", "num_decode_tokens"} <= header:
        if "rate" not in kw:
            raise ArrivalsNeeded(
                f"{where}: a length-only trace (no arrival times): pass rate= "
                "(and optionally process=, cv=, seed=, n=)",
                ("rate",),
            )
        return load_lengths
    if {"Timestamp", "Request tokens", "Response tokens"} <= header:
        return load_burstgpt
    if {"model", "field", "value", "prob"} <= header:
        if "rate" not in kw or "n" not in kw:
            raise ArrivalsNeeded(
                f"{where}: a length distribution (no requests): pass n= and rate=", ("n", "rate")
            )
        return load_servegen_reasoning
    raise TraceError(f"{where}: unknown trace format; header seen: {first.strip()[:200]!r}")


def bundled_trace_path() -> Path:
    """Path of the bundled Azure conv window (first 600 s of AzureLLMInferenceTrace_conv.csv)."""
    ref = resources.files("sim").joinpath("data", BUNDLED_FILE)
    if not isinstance(ref, Path):  # e.g. a zipped install: no real file to point at
        raise TraceError(
            f"{BUNDLED_FILE}: the package is not installed as files; use load_bundled()"
        )
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
