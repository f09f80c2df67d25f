"""Drive a real vLLM v1 scheduler in-process: no server, no workers, no model execution.

What vLLM's own scheduler unit tests do (``tests/v1/core/utils.py::create_scheduler``), for the
vLLM this repository pins (0.32–0.33):

* :func:`make_scheduler` builds a ``VllmConfig`` (a ``ModelConfig`` read from a model directory,
  a ``SchedulerConfig`` with chunked prefill, a ``CacheConfig``) and a ``KVCacheConfig`` with an
  exact number of blocks (one full-attention group), then instantiates any ``Scheduler``
  subclass — the stock one or tailpilot's plugin classes.
* :func:`make_request` builds a ``vllm.v1.request.Request`` carrying tailpilot's
  ``extra_args`` (tenant / type), with ``ignore_eos`` so it runs to exactly ``max_tokens``.
* :func:`step` runs one ``schedule()`` and feeds ``update_from_output()`` a fabricated
  ``ModelRunnerOutput`` that samples one token for every request whose prefill completed in
  that step (its ``num_computed_tokens`` reached its ``num_tokens``).
* :class:`Driver` does the same the way vLLM's EngineCore loop does — synchronously, or
  ``pipelined`` (two steps in flight, for the async scheduler) — with scripted arrivals, and
  records every step (scheduled tokens in vLLM's order, admissions, preemptions) and the tokens
  and finish reason each request receives.

The model directory only needs a ``config.json``: ``ModelConfig`` reads the architecture and the
geometry from it, and with ``skip_tokenizer_init`` nothing else is loaded.
:func:`minimal_model_dir` writes one; the tests may pass the tiny Llama of ``tests/conftest.py``
instead. :func:`make_scheduler` sets ``TAILPILOT_API_PORT=-1`` while it builds a plugin scheduler,
so that no HTTP control server starts, and writes ``settings`` to the file
``TAILPILOT_SETTINGS_FILE`` names. A plugin scheduler starts the history predictor's refit
thread: ``shutdown()`` stops it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

if TYPE_CHECKING:  # imported at the first use (_import_vllm), not with this module
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager


def _import_vllm() -> None:
    """Import torch and vLLM into this module's names, once, where the first scheduler or request
    is built. Not with the module: every pytest-xdist worker collects every test module, and
    importing vLLM (torch and transformers with it) cost each worker ~15 s of a core at collection
    (24 s against 8 s for the whole suite's), though one worker runs these tests."""
    global torch, CacheConfig, ModelConfig, SchedulerConfig, VllmConfig, SamplingParams
    global SchedulerOutput, Scheduler, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    global ModelRunnerOutput, Request, StructuredOutputManager
    if "StructuredOutputManager" in globals():
        return
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager


class Deferred:
    """A class named where a test module is collected and imported at its first use, so that
    ``parametrize`` can list vLLM's and the plugin's scheduler classes without importing vLLM at
    collection. Identity holds (``cls is STOCK``); ``load()`` is the class, and its attributes
    are read through (``RequestStatus.PREEMPTED``)."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def load(self) -> Any:
        return getattr(importlib.import_module(self.module), self.name)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # pytest's collection asks for __name__ and the like: no import
            raise AttributeError(attr)
        return getattr(self.load(), attr)

    def __repr__(self) -> str:
        return self.name


STOCK = Deferred("vllm.v1.core.sched.scheduler", "Scheduler")
STOCK_ASYNC = Deferred("vllm.v1.core.sched.async_scheduler", "AsyncScheduler")
PLUGIN = Deferred("scheduler.plugin.vllm", "TailpilotScheduler")
PLUGIN_ASYNC = Deferred("scheduler.plugin.vllm", "TailpilotAsyncScheduler")
STATUS = Deferred("vllm.v1.request", "RequestStatus")


def loaded(cls: Any) -> Any:
    """``cls``, or the class a :class:`Deferred` names."""
    return cls.load() if isinstance(cls, Deferred) else cls


def pipelined(cls: Any) -> bool:
    """Whether ``cls`` is an async (pipelined) scheduler: two steps in flight."""
    return issubclass(loaded(cls), STOCK_ASYNC.load())


PORT_ENV = "TAILPILOT_API_PORT"
SETTINGS_FILE_ENV = "TAILPILOT_SETTINGS_FILE"

MAX_MODEL_LEN = 4096  # the tiny Llama of tests/vllm_support.py has 4096 positions
SAMPLED_TOKEN_ID = 7  # any id: ignore_eos is set, so no sampled token stops a request early

#: What ModelConfig reads: a Llama architecture and its geometry (no weights, no tokenizer).
MINIMAL_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": MAX_MODEL_LEN,
    "vocab_size": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}

_minimal_dir: Path | None = None


def minimal_model_dir(dest: Path | str | None = None) -> Path:
    """A model directory holding only ``config.json`` (enough for ModelConfig; cached per
    process)."""
    global _minimal_dir
    if dest is None:
        if _minimal_dir is not None and (_minimal_dir / "config.json").exists():
            return _minimal_dir
        dest = Path(tempfile.mkdtemp(prefix="tp-minimal-llama-"))
        _minimal_dir = dest
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(MINIMAL_LLAMA_CONFIG))
    return dest


def _set_env(values: dict[str, str | None]) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextlib.contextmanager
def _env(**values: str | None) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    try:
        _set_env(values)
        yield
    finally:
        _set_env(saved)


_model_configs: dict[tuple, ModelConfig] = {}


def make_vllm_config(
    *,
    model_dir: Path | str | None = None,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int = 16,
    long_prefill_token_threshold: int = 0,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = False,
    max_model_len: int = MAX_MODEL_LEN,
) -> VllmConfig:
    _import_vllm()
    model = str(model_dir or minimal_model_dir())
    key = (model, max_model_len)
    model_config = _model_configs.get(key)
    if model_config is None:  # ModelConfig is read-only for the scheduler: share it
        model_config = _model_configs[key] = ModelConfig(
            model=model,
            tokenizer=model,
            skip_tokenizer_init=True,
            dtype="float32",
            seed=0,
            max_model_len=max_model_len,
            trust_remote_code=False,
        )
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
        enable_chunked_prefill=enable_chunked_prefill,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=enable_prefix_caching,
    )
    vllm_config = VllmConfig(
        model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return vllm_config


def make_kv_cache_config(num_blocks: int, block_size: int = 16) -> KVCacheConfig:
    """One full-attention group with exactly ``num_blocks`` blocks (block 0 is vLLM's null
    block)."""
    _import_vllm()
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=32, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )


def make_scheduler(
    cls: type[Scheduler] | Deferred | None = None,
    *,
    num_blocks: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    settings: dict | None = None,
    block_size: int = 16,
    long_prefill_token_threshold: int = 0,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = False,
    model_dir: Path | str | None = None,
    max_model_len: int = MAX_MODEL_LEN,
    api_port: int = -1,
) -> Scheduler:
    """A scheduler of class ``cls`` over a KV cache of ``num_blocks`` blocks.

    ``settings`` is tailpilot's start-up settings document (written to a temporary file named by
    ``$TAILPILOT_SETTINGS_FILE`` while the scheduler is built); None gives the plugin's default
    (sarathi). The plugin's control server is disabled (``$TAILPILOT_API_PORT=-1``) unless
    ``api_port`` is given. ``cls`` defaults to vLLM's stock ``Scheduler``.
    """
    _import_vllm()
    cls = loaded(cls) if cls is not None else Scheduler
    vllm_config = make_vllm_config(
        model_dir=model_dir,
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        long_prefill_token_threshold=long_prefill_token_threshold,
        enable_chunked_prefill=enable_chunked_prefill,
        enable_prefix_caching=enable_prefix_caching,
        max_model_len=max_model_len,
    )
    kv_cache_config = make_kv_cache_config(num_blocks, block_size)
    with tempfile.TemporaryDirectory(prefix="tp-settings-") as tmp:
        settings_path = None
        if settings is not None:
            settings_path = str(Path(tmp) / "settings.json")
            Path(settings_path).write_text(json.dumps(settings))
        with _env(**{SETTINGS_FILE_ENV: settings_path, PORT_ENV: str(api_port)}):
            return cls(
                vllm_config=vllm_config,
                kv_cache_config=kv_cache_config,
                structured_output_manager=StructuredOutputManager(vllm_config),
                block_size=block_size,
                log_stats=False,
            )


_token_seed = iter(range(1, 1 << 30))


def make_request(
    id: str,
    prompt_len: int,
    max_tokens: int,
    arrival: float | None = None,
    *,
    tenant: str = "default",
    type: str = "chat",
    prompt_token_ids: list[int] | None = None,
    block_hasher: Any = None,
) -> Request:
    """A request of ``prompt_len`` prompt tokens that generates exactly ``max_tokens`` tokens.

    Prompts differ between requests (no accidental prefix-cache hits when caching is on).
    ``arrival`` is the request's ``arrival_time`` (seconds, any epoch; policies compare them).
    ``block_hasher`` (:func:`block_hasher`) is what vLLM's engine core gives every request when
    prefix caching is on: a scheduler built with ``enable_prefix_caching`` needs it.
    """
    _import_vllm()
    if prompt_token_ids is None:
        base = next(_token_seed) * 7919
        prompt_token_ids = [10 + (base + i * 31) % 4000 for i in range(prompt_len)]
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        temperature=0.0,
        extra_args={"tenant": tenant, "type": type},
    )
    return Request(
        request_id=id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=params,
        pooling_params=None,
        arrival_time=time.time() if arrival is None else arrival,
        block_hasher=block_hasher,
    )


def block_hasher(block_size: int = 16) -> Any:
    """The block hasher vLLM's engine core builds when prefix caching is on (its default hash)."""
    _import_vllm()
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(CacheConfig().prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(block_size, hash_fn)


def fake_model_output(
    scheduler: Scheduler, output: SchedulerOutput, token_id: int = SAMPLED_TOKEN_ID
) -> ModelRunnerOutput:
    """What a model runner returns for ``output``: one sampled token for each scheduled request
    whose prefill completed this step, nothing for one still mid-prefill.

    Call it right after ``schedule()`` (before the next one): ``schedule()`` has advanced each
    scheduled request's ``num_computed_tokens`` and set ``is_prefill_chunk``, i.e. whether its
    ``num_computed_tokens`` is still short of its ``num_tokens`` (plus, under async scheduling, the
    placeholders of tokens in flight).
    """
    _import_vllm()  # ``scheduler`` may have been built without this module
    req_ids = list(output.num_scheduled_tokens)
    sampled: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        # is_prefill_chunk: num_computed_tokens < num_tokens (+ in-flight placeholders under async
        # scheduling), set by schedule() for every scheduled request.
        sampled.append([] if request.is_prefill_chunk else [token_id])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One engine step: ``schedule()``, then ``update_from_output()`` with a fabricated output."""
    output = scheduler.schedule()
    scheduler.update_from_output(output, fake_model_output(scheduler, output))
    return output


def admitted(output: SchedulerOutput) -> list[str]:
    """Requests scheduled for the first time (new) or resumed after a preemption in ``output``."""
    new = [r.req_id for r in output.scheduled_new_reqs]
    cached = output.scheduled_cached_reqs
    return new + [rid for rid in cached.req_ids if rid in cached.resumed_req_ids]


@dataclass
class StepRecord:
    """What one ``schedule()`` decided, in vLLM's own terms."""

    index: int
    scheduled: list[tuple[str, int]]  # (request id, tokens), in the order vLLM scheduled them
    admitted: list[str]  # new or resumed this step
    preempted: list[str]  # preempted since the previous schedule() (sorted)
    finished: list[str] = field(default_factory=list)  # finished by the output processed after it


class Driver:
    """Runs a scheduler like vLLM's EngineCore does, with a fabricated model.

    ``pipelined=False``: schedule, then process that step's output (the synchronous engine loop).
    ``pipelined=True``: keep up to two steps in flight — schedule step N+1 before processing
    step N's output — as the engine's batch queue does with async scheduling (use it with an
    ``AsyncScheduler``).

    Counts the output tokens each request receives from the ``EngineCoreOutputs`` that
    ``update_from_output`` returns, and records every step.
    """

    def __init__(self, scheduler: Scheduler, *, pipelined: bool = False) -> None:
        self.scheduler = scheduler
        self.pipelined = pipelined
        self.tokens: dict[str, int] = {}
        self.finished: dict[str, str] = {}
        self.history: list[StepRecord] = []
        self.first_admitted: list[str] = []  # request ids in order of first admission
        self.requests: dict[str, Request] = {}
        self._inflight: deque[tuple[SchedulerOutput, ModelRunnerOutput, StepRecord]] = deque()

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.requests[request.request_id] = request
            self.scheduler.add_request(request)

    def _process(self) -> None:
        output, runner_output, record = self._inflight.popleft()
        engine_outputs = self.scheduler.update_from_output(output, runner_output)
        for outs in engine_outputs.values():
            for o in outs.outputs:
                self.tokens[o.request_id] = self.tokens.get(o.request_id, 0) + len(o.new_token_ids)
                if o.finish_reason is not None:
                    assert o.request_id not in self.finished, f"{o.request_id} finished twice"
                    self.finished[o.request_id] = str(o.finish_reason)
                    record.finished.append(o.request_id)

    def step(self) -> StepRecord:
        """Schedule one step (and process the output that is due). Returns the step's record."""
        s = self.scheduler
        output = s.schedule()
        runner_output = fake_model_output(s, output)
        record = StepRecord(
            index=len(self.history),
            scheduled=list(output.num_scheduled_tokens.items()),
            admitted=admitted(output),
            preempted=sorted(output.preempted_req_ids),
        )
        for rid in record.admitted:
            if rid not in self.first_admitted:
                self.first_admitted.append(rid)
        self.history.append(record)
        self._inflight.append((output, runner_output, record))
        if not self.pipelined or len(self._inflight) >= 2:
            self._process()
        return record

    def drain(self) -> None:
        """Process every output still in flight."""
        while self._inflight:
            self._process()

    def busy(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._inflight)

    def run(
        self,
        *,
        arrivals: dict[int, list[Request]] | None = None,
        max_steps: int = 20_000,
        steps: int | None = None,
        on_step=None,
    ) -> int:
        """Step until the scheduler is empty (or for ``steps`` steps). ``arrivals[k]`` are added
        just before the k-th step of this call. Returns the number of steps taken."""
        arrivals = dict(arrivals or {})
        n = 0
        while True:
            for request in arrivals.pop(n, []):
                self.add(request)
            if steps is not None and n >= steps:
                break
            if steps is None and not arrivals and not self.busy():
                break
            if self._inflight and not self.scheduler.has_unfinished_requests():
                self.drain()  # the last outputs of a pipelined run
                continue
            record = self.step()  # with nothing to schedule, an empty step: the clock of `arrivals`
            if on_step is not None:
                on_step(record)
            n += 1
            if n >= max_steps:
                s = self.scheduler
                raise AssertionError(
                    f"not done after {max_steps} steps: {len(s.running)} running, "
                    f"{len(s.waiting)} waiting"
                )
        return n


__all__ = [
    "MINIMAL_LLAMA_CONFIG",
    "PLUGIN",
    "PLUGIN_ASYNC",
    "STATUS",
    "STOCK",
    "STOCK_ASYNC",
    "Deferred",
    "Driver",
    "StepRecord",
    "admitted",
    "fake_model_output",
    "loaded",
    "make_kv_cache_config",
    "make_request",
    "make_scheduler",
    "make_vllm_config",
    "minimal_model_dir",
    "pipelined",
    "step",
]
