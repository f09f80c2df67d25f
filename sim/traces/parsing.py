"""Reading trace files: field parsers, exact Azure timestamps, CSV rows with line numbers, and
the column accumulator the loaders build a `Trace` from.

Every helper reports malformed input as a `TraceError` whose message starts with
`<file>:<line>:` (1-based, header = line 1) and names the offending column.
"""

from __future__ import annotations

import csv
import datetime as _dt
import math
import os
import re
from collections.abc import Iterator, Sequence
from typing import IO

from scheduler.names import DEFAULT_TENANT, DEFAULT_TYPE
from sim.traces.model import REQUEST_TYPES, Trace, TraceError, TraceRequest

PathLike = str | os.PathLike[str]


# --------------------------------------------------------------------------------------------
# Field parsing: every helper raises TraceError("<file>:<line>: column '<c>': ...")
# --------------------------------------------------------------------------------------------


def field_error(where: str, line: int, column: str, what: str) -> TraceError:
    """The error for a bad value: `<where>:<line>: column '<column>': <what>`."""
    return TraceError(f"{where}:{line}: column {column!r}: {what}")


def parse_tokens(text: str, where: str, line: int, column: str, minimum: int = 1) -> int:
    """A token count: an integer >= minimum. Integral float text ("12.0", as pandas writes) is
    accepted."""
    value: int | None
    try:
        value = int(text)
    except ValueError:
        value = _integral_float(text)
        if value is None:
            if not text.strip():
                raise field_error(
                    where, line, column, "empty value, expected a token count"
                ) from None
            raise field_error(
                where, line, column, f"{text!r} is not an integer token count"
            ) from None
    if value < minimum:
        raise field_error(where, line, column, f"token count must be >= {minimum}, got {value}")
    return value


def _integral_float(text: str) -> int | None:
    try:
        f = float(text)
    except ValueError:
        return None
    return int(f) if math.isfinite(f) and f.is_integer() else None


def parse_float(text: str, where: str, line: int, column: str) -> float:
    """A finite number (empty, non-numeric, inf and nan text are errors)."""
    try:
        value = float(text)
    except ValueError:
        what = "empty value, expected a number" if not text.strip() else f"{text!r} is not a number"
        raise field_error(where, line, column, what) from None
    if not math.isfinite(value):
        raise field_error(where, line, column, f"{text!r} is not a finite number")
    return value


def parse_type(text: str, where: str, line: int, column: str) -> str:
    """A request type, one of `REQUEST_TYPES`; an empty cell is the default type "chat"."""
    value = text.strip() or DEFAULT_TYPE  # an empty cell means "not specified" -> the default type
    if value not in REQUEST_TYPES:
        raise field_error(where, line, column, f"{text!r} is not one of {sorted(REQUEST_TYPES)}")
    return value


# Azure timestamps: "2023-11-16 18:15:46.6805900" (7 fractional digits = 100 ns ticks).
_AZURE_TS = re.compile(r"((\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2})):(\d{2})(?:\.(\d{1,7}))?")
#: Ticks of `AzureClock.ticks` per second (100 ns each).
AZURE_TICKS_PER_S = 10_000_000


class AzureClock:
    """Parses Azure timestamps to integer 100-ns ticks, exactly (no float, no pandas).

    The "YYYY-MM-DD HH:MM" part is converted once per distinct minute and cached: a trace spans
    few minutes compared with its rows, and this keeps the 19k-row conv file well under 0.1 s.
    """

    __slots__ = ("_minutes",)

    def __init__(self) -> None:
        self._minutes: dict[str, int] = {}

    def ticks(self, text: str, where: str, line: int, column: str) -> int:
        """`text` ("YYYY-MM-DD HH:MM:SS.fffffff") as 100-ns ticks since 0001-01-01."""
        m = _AZURE_TS.fullmatch(text.strip())
        if m is None:
            raise field_error(
                where, line, column, f"{text!r} is not a timestamp 'YYYY-MM-DD HH:MM:SS.fffffff'"
            )
        minute, ss, frac = m.group(1, 7, 8)
        base = self._minutes.get(minute)
        if base is None:
            base = self._minute_seconds(m, text, where, line, column)
            self._minutes[minute] = base
        s = int(ss)
        if s > 59:
            raise field_error(where, line, column, f"{text!r}: seconds out of range")
        return (base + s) * AZURE_TICKS_PER_S + (int(frac.ljust(7, "0")) if frac else 0)

    @staticmethod
    def _minute_seconds(m: re.Match[str], text: str, where: str, line: int, column: str) -> int:
        y, mo, d, hh, mi = (int(g) for g in m.group(2, 3, 4, 5, 6))
        try:
            day = _dt.date(y, mo, d).toordinal()
        except ValueError as e:
            raise field_error(where, line, column, f"{text!r}: {e}") from None
        if hh > 23 or mi > 59:
            raise field_error(where, line, column, f"{text!r}: time of day out of range")
        return ((day * 24 + hh) * 60 + mi) * 60


# --------------------------------------------------------------------------------------------
# File access
# --------------------------------------------------------------------------------------------


def open_trace_file(path: PathLike) -> IO[str]:
    """`path` opened for reading as text; a missing or unreadable file is a `TraceError`."""
    # utf-8-sig: tolerate a BOM written by spreadsheet tools; newline="" as the csv module wants.
    try:
        return open(path, newline="", encoding="utf-8-sig")
    except FileNotFoundError:
        raise TraceError(f"{os.fspath(path)}: no such file") from None
    except OSError as e:
        raise TraceError(f"{os.fspath(path)}: cannot open: {e.strerror or e}") from None


class CsvRows:
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
            raise TraceError(
                f"{where}:1: empty file, expected a header with columns {list(required)}"
            )
        self.header = [h.strip() for h in header]
        self.columns: dict[str, int] = {}
        for i, name in enumerate(self.header):
            if name in self.columns:
                raise TraceError(f"{where}:1: duplicate column {name!r}")
            self.columns[name] = i
        for name in required:
            if name not in self.columns:
                raise TraceError(
                    f"{where}:1: missing column {name!r} (header: {','.join(self.header)})"
                )

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
                        raise field_error(self.where, line, self.header[len(row)], what)
                    raise TraceError(
                        f"{self.where}:{line}: row has {len(row)} fields, header has {width}"
                    )
                yield reader.line_num, row
        except (csv.Error, UnicodeDecodeError) as e:
            raise TraceError(f"{self.where}:{reader.line_num}: {e}") from None


# --------------------------------------------------------------------------------------------
# Rows to requests
# --------------------------------------------------------------------------------------------


def request_ids(prefix: str, indices: Sequence[int]) -> list[str]:
    """Ids `<prefix>-<index>` for the given 0-based data-row indices."""
    # Zero-pad to one width per trace so lexicographic id order == row order (ties in arrival).
    width = max(6, len(str(max(indices, default=0))))
    return [f"{prefix}-{i:0{width}d}" for i in indices]


class ParsedRows:
    """Column-oriented accumulator for parsed rows, turned into a re-zeroed Trace at the end."""

    __slots__ = ("arrival", "index", "max_tokens", "output", "prompt", "tenant", "type")

    def __init__(self) -> None:
        self.index: list[int] = []
        self.arrival: list[float] = []
        self.prompt: list[int] = []
        self.output: list[int] = []
        self.max_tokens: list[int | None] = []
        self.tenant: list[str] = []
        self.type: list[str] = []

    def add(
        self,
        index: int,
        arrival: float,
        prompt: int,
        output: int,
        max_tokens: int | None = None,
        tenant: str = DEFAULT_TENANT,
        type: str = DEFAULT_TYPE,
    ) -> None:
        self.index.append(index)
        self.arrival.append(arrival)
        self.prompt.append(prompt)
        self.output.append(output)
        self.max_tokens.append(max_tokens)
        self.tenant.append(tenant)
        self.type.append(type)

    def to_trace(self, name: str, prefix: str, default_cap: int, *, skipped: int = 0) -> Trace:
        t0 = min(self.arrival, default=0.0)  # re-zero: the first request arrives at 0.0
        ids = request_ids(prefix, self.index)
        requests = tuple(
            source_request(rid, a - t0, p, o, m, default_cap, ten, typ)
            for rid, a, p, o, m, ten, typ in zip(
                ids, self.arrival, self.prompt, self.output, self.max_tokens, self.tenant, self.type
            )
        )
        return Trace(name, requests, skipped)


def source_request(
    rid: str,
    arrival: float,
    prompt: int,
    output: int,
    recorded_cap: int | None,
    default_cap: int,
    tenant: str = DEFAULT_TENANT,
    type: str = DEFAULT_TYPE,
) -> TraceRequest:
    """A source row as a request. A cap the source recorded is kept as it is; a row without one
    gets `default_cap`, and an output longer than that is truncated to it (as a server would) and
    flagged. Never `max_tokens = output`: the cap must not tell a policy the true length."""
    if recorded_cap is not None:
        return TraceRequest(rid, arrival, prompt, output, recorded_cap, tenant, type)
    if output > default_cap:
        return TraceRequest(
            rid, arrival, prompt, default_cap, default_cap, tenant, type, truncated=True
        )
    return TraceRequest(rid, arrival, prompt, output, default_cap, tenant, type)
