"""The autopilot: the scheduler's settings chosen online from the past only (README, "The
autopilot").

``controller`` (the decision rule; ``AutopilotConfig``, its knobs, from ``config``),
``candidates`` (the settings it compares and the search that keeps some running), ``promise``
(what it keeps), ``shadows`` (a simulator per candidate), ``feed`` (what the shadows are fed and
the decision's window), ``shape`` (a change of the traffic's shape), ``types`` (what it sees and
says);
``stress`` and ``overload`` (the stress test, the overload watch); ``replay`` (in the
simulator), ``live`` (on a live cluster) with ``replica_pilot`` (a replica's controller and what
its reports become) and ``records`` (its audit rows and predictions), and ``tune`` (its own
knobs).
"""

# Used by other floors (tests/test_layers.py); the rest serve these.
__all__ = ["controller", "live", "records", "replay", "tune"]
