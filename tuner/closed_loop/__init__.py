"""The closed loop: a live replica measured, and a change predicted before it is applied and
verified after.

``replica_facts`` (reading a replica's step log and engine facts), ``calibrate`` (its step-time
model), ``recorded`` (a recording as a trace), ``fidelity`` (how faithfully the simulator replays
it), ``whatif`` (predict before apply, verify after), ``capacity`` (how many replicas keep SCR).
"""

__all__ = ["calibrate", "capacity", "fidelity", "recorded", "replica_facts", "whatif"]
