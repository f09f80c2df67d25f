"""Shared pytest fixtures. The vLLM helpers live in tests/vllm_support.py."""

from vllm_support import tiny_model_dir  # noqa: F401  (re-exported fixture)
