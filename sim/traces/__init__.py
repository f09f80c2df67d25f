"""Workload traces for the tuner: loaders for public LLM-serving traces, and pure transforms.

A trace is an immutable, arrival-sorted sequence of `TraceRequest`s (docs/engine.md#requests):
arrival time in seconds relative to the first request, prompt and output token counts,
`max_tokens`, tenant and request type. Every loader re-zeroes arrivals so the first request
arrives at 0.0, gives each request an id `<prefix>-<row index>` (0-based data-row index,
zero-padded so ids sort in file order), and reports malformed input as a `TraceError` whose
message starts with `<file>:<line>:` (1-based, header = line 1) and names the offending column.
Nothing is dropped silently: the only loader that drops rows by design (BurstGPT failures) counts
them in `Trace.skipped`.

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
* ServeGen-derived length PMFs (`model,field,value,prob`), reasoning type
                                                       -> `load_servegen_reasoning`

Bundled data: `sim/data/azure_conv_window.csv` holds the first 600 s (2,867 rows, byte-for-byte,
same header) of AzureLLMInferenceTrace_conv.csv from Azure/AzurePublicDataset, licensed CC BY 4.0;
please cite Patel et al., "Splitwise: Efficient Generative LLM Inference Using Phase Splitting",
ISCA 2024. See `bundled_trace_path()` and `load_bundled()`.

Modules: `model` (`Trace`, `TraceRequest`, `TraceError`), `parsing` (field parsers and CSV rows the
loaders share), `loaders` (one loader per format, format detection, the bundled window),
`arrivals` (generated arrival processes), `transforms` (pure functions from Trace to Trace). This
package's namespace is the public API: import from `sim.traces`.
"""

from sim.traces.arrivals import generate_arrivals
from sim.traces.loaders import (
    BUNDLED_FILE,
    ArrivalsNeeded,
    bundled_trace_path,
    load_azure,
    load_bundled,
    load_burstgpt,
    load_lengths,
    load_mooncake,
    load_servegen_reasoning,
    load_trace,
    load_vidur,
)
from sim.traces.model import DEFAULT_MAX_TOKENS, REQUEST_TYPES, Trace, TraceError, TraceRequest
from sim.traces.transforms import (
    assign_tenants_from,
    assign_tenants_zipf,
    cap_max_tokens,
    mix,
    scale_rate,
    scale_tokens,
    target_rate,
    time_window,
    transform,
    with_type,
)

__all__ = [
    "BUNDLED_FILE",
    "DEFAULT_MAX_TOKENS",
    "REQUEST_TYPES",
    "ArrivalsNeeded",
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
    "transform",
    "with_type",
]
