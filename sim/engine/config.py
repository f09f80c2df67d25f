"""The replica a simulation models: KV capacity, block size and step-time model (`EngineConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from sim.stepmodel import DEFAULT_MODEL_NAME, StepTimeModel, get_model


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Replica facts that do not change live (the settings document holds the live limits)."""

    # ≈ 50 GiB of KV on an A100-80GB for Llama-3-8B at 128 KiB/token (sim/stepmodel.py: 32 layers
    # × 8 KV heads × 128 dims × 2 × 2 bytes).
    num_gpu_blocks: int = 25_000
    block_size: int = 16
    step_model: StepTimeModel = field(default_factory=lambda: get_model(DEFAULT_MODEL_NAME))
    refit_interval_s: float = 10.0  # history predictor refit period (off the scheduling path)
    # vLLM 0.32's scheduler_reserve_full_isl (default on): admit a request only if its whole
    # sequence (prompt + generated) fits in the free blocks, though only its chunk is allocated.
    reserve_full_sequence: bool = True
    # vLLM's enable_prefix_caching (on by default in V1): a preempted request's full blocks keep
    # their hashes until reused, so readmitted in time it recomputes only what was taken
    # (docs/engine.md#prefix-cache). Traces carry no token ids: prompts never share a prefix here.
    prefix_caching: bool = True
