"""The engine simulator: a vLLM v1 replica's scheduling step replayed on a trace (docs/engine.md).

``sim.engine`` (the simulator), ``sim.stepmodel`` (step-time models and vLLM's engine defaults per
GPU), ``sim.traces`` (trace loaders and transforms; ``sim/data`` holds the bundled window). The CLI,
the twin replicas and the tuner all use it; it imports the policy library and nothing above.
"""

# The rooms other floors may use (tests/test_layers.py: an import from another floor names one).
__all__ = [
    "engine",
    "noisy",
    "stepmodel",
    "traces",
]
