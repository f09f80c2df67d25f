"""The operator's side: collector, recorder, steering, governor, exporter, monitoring, exports.

It drives replicas through the control API whose contract lives in ``scheduler``.
"""
