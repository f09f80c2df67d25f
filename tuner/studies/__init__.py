"""Offline studies: Optuna searches over policy and engine settings on replayed traces.

``spec`` (a study's definition), ``windows`` (the traces cut into warm-started windows),
``search`` and ``objectives`` (the space, the objectives and constraints), ``study`` (create, join,
resume), ``lookup`` (a study by its name: loaded, whether it exists, the message when missing),
``optimize`` (the worker loop: ``tailpilot tune``) with ``samplers`` (its samplers and their
streams), ``optuna_storage`` (where a study lives),
``results`` (its best trials), ``recommend`` (validated on held-out windows) and ``continuous`` (a
recommendation replayed over the whole trace).
"""

# Used by other floors (tests/test_layers.py); ``windows``, ``objectives`` and ``continuous``
# serve these.
__all__ = [
    "lookup",
    "optimize",
    "optuna_storage",
    "recommend",
    "results",
    "samplers",
    "search",
    "spec",
    "study",
]
