"""The operator's side: collector, recorder, steering, governor, exporter, monitoring, exports.

It drives replicas through the control API whose contract lives in ``scheduler``.
"""

# The rooms other floors may use (tests/test_layers.py: an import from another floor names one);
# the rest (prom, series, window, writer, exporter, strict_yaml) serve these.
__all__ = [
    "cluster",
    "collector",
    "controller_host",
    "export",
    "governance",
    "governor",
    "governor_live",
    "http",
    "monitoring",
    "poller",
    "recorder",
    "replica_http",
    "retry",
    "snapshot",
    "steering",
    "verification",
    "views",
]
