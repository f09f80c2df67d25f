"""The ``tailpilot`` command: above everything it imports, imported by nothing (entry points aside).

``cli.py`` (the group and ``schema``), ``cli_sim.py`` (``sim``, ``compare``, ``capacity``),
``cli_twin.py`` (``twin``, ``demo``), ``cli_cluster.py`` (``status``, ``set``, ``verify``, ``tui``),
``cli_record.py`` (``record``, ``governor``, ``autopilot``), ``cli_tune.py`` (``tune``,
``recommend``; ``study_options.py`` the options that define a study, ``recommend_view.py`` how
a recommendation prints), ``cli_export.py`` (``export``, ``calibrate``), ``cli_loop.py``
(``fidelity``). Every command is a thin layer over a library call. What the commands share:
``options.py`` (the option vocabulary, one definition per option several commands take;
docs/cli.md), ``cli_trace.py`` (choosing and shaping a trace, sizing the simulated engine) and
``cli_common.py`` (parameter types, strict JSON output).

Start-up cost: the library modules a command runs (the simulator, the tuner, the store, the
collector, the TUI) are imported inside the command. Importing them all up front takes about
4 s against 0.2 to 0.7 s for the command line alone (``python -X importtime``, a shared 2-core
machine), and every ``tailpilot --help``, every mistyped option and every shell completion would
pay it. Such an import carries the comment ``# start-up cost``.
"""

# The command line's one public room: ``tailpilot.cli`` (``main``, the console script).
__all__ = [
    "cli",
]
