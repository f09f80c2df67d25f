"""The tuner floor: four concerns over the simulator.

- offline studies: ``spec``, ``windows``, ``search``, ``objectives``, ``study``, ``optimize``,
  ``optuna_storage``, ``results``, ``recommend``, ``continuous`` (``tailpilot tune``/``recommend``);
- the online autopilot: ``autopilot`` (the decision rule), ``candidates``, ``promise``,
  ``shadows``, ``autopilot_types``, ``autopilot_replay``, ``autopilot_live``,
  ``autopilot_records``, ``autopilot_tune``;
- twins, simulated replicas behind the control API: ``twin``, ``twin_feed``, ``twin_metrics``;
- the closed loop: ``calibrate``, ``replica_facts``, ``recorded``, ``fidelity``, ``whatif``,
  ``capacity``.
"""

# The rooms other floors may use (tests/test_layers.py: an import from another floor names one);
# the rest serve these (the autopilot's candidates, promise, shadows and types; a study's
# objectives and windows; the twins' feed and metrics).
__all__ = [
    "autopilot",
    "autopilot_live",
    "autopilot_replay",
    "autopilot_tune",
    "calibrate",
    "capacity",
    "fidelity",
    "optimize",
    "optuna_storage",
    "recommend",
    "recorded",
    "replica_facts",
    "results",
    "search",
    "spec",
    "study",
    "twin",
    "whatif",
]
