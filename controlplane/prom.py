"""vLLM's Prometheus page (``GET {api_url}/metrics``) as a few numbers the collector needs.

Parsed with ``prometheus_client``'s parser through :data:`VLLM_METRICS`, a table of the metric
names different vLLM versions use; a page that is not Prometheus text is an error naming its line,
and a page of more than :data:`MAX_METRICS_SERIES` series is refused before any line is parsed.
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

from scheduler.errors import FAILED, TailpilotError

#: logical name -> (aggregation over label sets, metric family names across vLLM versions, newest
#: first). Family names are given without the ``_total`` suffix: prometheus_client strips it from
#: counter families (``vllm:num_preemptions_total`` is family ``vllm:num_preemptions``), and an
#: untyped sample keeps it, so both spellings are matched.
VLLM_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "running": ("sum", ("vllm:num_requests_running",)),
    "waiting": ("sum", ("vllm:num_requests_waiting",)),
    # v1 (>= 0.8): kv_cache_usage_perc; v0: gpu_cache_usage_perc. Both are 0..1 despite "perc".
    "kv_usage": ("mean", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
    "preemptions_total": ("sum", ("vllm:num_preemptions", "vllm:num_preemption")),
    "prompt_tokens_total": ("sum", ("vllm:prompt_tokens",)),
    "generation_tokens_total": ("sum", ("vllm:generation_tokens",)),
    "requests_total": ("sum", ("vllm:request_success",)),
}
#: The most sample lines a /metrics page may have. One vLLM engine's page has ~600 (mostly
#: histogram buckets); 50,000 is dozens of engines or models, and bounds the parse (on a worker
#: thread) to ~0.1 s (the page's byte cap is replica_http.MAX_METRICS_BYTES). A page of hundreds of
#: thousands of series is no vLLM page: refused by counting its lines (~2 ms for 300,000), unparsed.
MAX_METRICS_SERIES = 50_000
_FAMILY_TO_LOGICAL: dict[str, str] = {
    fam: logical for logical, (_, fams) in VLLM_METRICS.items() for fam in fams
}


class MetricsFormatError(TailpilotError, ValueError):
    """A /metrics page that is not Prometheus text; the message names the line."""

    exit_code = FAILED


def _strip_total(name: str) -> str:
    return name[:-6] if name.endswith("_total") else name


def _locate_bad_line(text: str) -> str:
    """Parse line by line to name the first line prometheus_client refuses (error path only)."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        try:
            for _ in text_string_to_metric_families(line + "\n"):
                pass
        except Exception as err:
            shown = line if len(line) <= 80 else line[:77] + "..."
            return f"line {number}: {shown!r} ({err or type(err).__name__})"
    return "unparseable text"


# The shape of a sample line: name, optional {labels}, value, optional timestamp. Lenient inside
# the braces (fast: ~0.5 µs a line); the lines the collector uses are parsed strictly.
_SAMPLE_LINE = re.compile(
    r"[ \t]*[A-Za-z_:][A-Za-z0-9_:]*"  # the name
    r'(?:[ \t]*\{.*\}[ \t]*|[ \t]+)[^ \t{}"]+'  # {labels} or a space, the value
    r"(?:[ \t]+-?[0-9.]+)?[ \t]*"  # a timestamp
)
# The lines of the families in VLLM_METRICS: their samples and TYPE comments (HELP text is not
# needed). A cheap prefix test first, then the exact family name (not a longer one it begins).
_LINE_PREFIXES: tuple[str, ...] = tuple(
    p for fam in _FAMILY_TO_LOGICAL for p in (fam, f"# TYPE {fam}")
)
_FAMILY_LINE = re.compile(
    r"(?:# TYPE )?(?:" + "|".join(re.escape(f) for f in _FAMILY_TO_LOGICAL) + r")(?:_total)?[ \t{]"
)


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """vLLM's /metrics text -> {logical name: value} for the names in :data:`VLLM_METRICS` found.

    Counters and gauges are summed over label sets (engines, models) except ``kv_usage`` (mean);
    for a logical name with several candidate families the first (newest) one present wins.

    Only the lines of the families in the table go through ``prometheus_client``'s parser (a vLLM
    page is mostly histogram buckets the collector does not use, and the pure-Python parser costs
    ~15 µs a line); every other sample line must still have the shape of one (a lenient regular
    expression, ~0.5 µs a line), so a garbled or truncated page is caught wherever it is garbled.
    A page without any of the table's lines is parsed whole, to tell malformed text from a page
    that simply has no vLLM metrics. Raises :class:`MetricsFormatError` naming the first bad line,
    or the count of a page of more than :data:`MAX_METRICS_SERIES` series.
    """
    series = count_series(text)
    if series > MAX_METRICS_SERIES:
        raise MetricsFormatError(
            f"metrics: the page has {series:,} series, more than the "
            f"{MAX_METRICS_SERIES:,} the collector reads"
        )
    keep: list[str] = []
    fullmatch, family_line = _SAMPLE_LINE.fullmatch, _FAMILY_LINE.match
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith(_LINE_PREFIXES) and family_line(line):
            keep.append(line)
        elif line and line[0] != "#" and fullmatch(line) is None and line.strip():
            shown = line if len(line) <= 80 else line[:77] + "..."
            raise MetricsFormatError(
                f"malformed metrics text at line {number}: {shown!r} (not a sample line)"
            )
    if not keep:
        _parse_families(text, text)
        return {}
    return _parse_families("\n".join(keep) + "\n", text)


def count_series(text: str) -> int:
    """The lines of a Prometheus page that are not comments (blank ones included: an upper bound),
    counted without a pass in Python."""
    lines = text.count("\n") + (not text.endswith("\n"))
    comments = text.count("\n#") + text.startswith("#")
    return lines - comments


def _parse_families(text: str, page: str) -> dict[str, float]:
    found: dict[str, dict[str, list[float]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            base = _strip_total(family.name)
            logical = _FAMILY_TO_LOGICAL.get(base)
            if logical is None:
                continue
            wanted = (base, base + "_total")
            values = [s.value for s in family.samples if s.name in wanted]
            if values:
                found.setdefault(logical, {}).setdefault(base, []).extend(values)
    except Exception as err:
        raise MetricsFormatError(f"malformed metrics text at {_locate_bad_line(page)}") from err
    out: dict[str, float] = {}
    for logical, by_family in found.items():
        agg, families = VLLM_METRICS[logical]
        for fam in families:
            fam_values = by_family.get(fam)
            if fam_values:
                out[logical] = float(
                    sum(fam_values) / len(fam_values) if agg == "mean" else sum(fam_values)
                )
                break
    return out
