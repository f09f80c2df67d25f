"""The tuner floor: four concerns over the simulator, a folder each.

- ``studies``: offline Optuna studies (``tailpilot tune``/``recommend``);
- ``autopilot``: choosing the settings online (the decision rule, its candidates, promise and
  shadows; in the simulator, on a live cluster; its own knobs tuned);
- ``twins``: simulated replicas behind the control API (``tailpilot twin``, the demo);
- ``closed_loop``: a live replica measured and predicted — calibrate, fidelity, what-if and
  verify, capacity, a recording replayed.
"""

# The rooms other floors may use (tests/test_layers.py: an import from another floor names one,
# and the module it names is one its folder declares).
__all__ = ["autopilot", "closed_loop", "studies", "twins"]
