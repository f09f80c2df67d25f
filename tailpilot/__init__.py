"""The ``tailpilot`` command: above everything it imports, imported by nothing (entry points aside).

``cli.py`` (the group; ``sim``, ``compare``, ``twin``, ``schema``), ``cli_cluster.py`` (``status``,
``set``, ``record``, ``tui``, ``demo``), ``cli_tune.py`` (``tune``, ``recommend``), ``cli_export.py``
(``export``, ``calibrate``). Every command is a thin layer over a library call.
"""
