"""``python -m tui``: the same command as ``tailpilot tui`` (one definition of its options).

python -m tui --cluster clusters.yaml [--cluster-name NAME] [--db URL] [--readonly]
python -m tui --replay --db recording.db [--cluster-name NAME] [--cluster FILE (for its SLOs)]
"""

from __future__ import annotations

import sys

# The CLI's group (not the TUI's entry point directly): it turns store failures into one-line
# errors, as `tailpilot tui` does.
from tailpilot.cli import main as tailpilot


def main(argv: list[str] | None = None) -> int:
    try:
        tailpilot.main(
            args=["tui", *(sys.argv[1:] if argv is None else argv)],
            prog_name="python -m",  # usage reads "python -m tui ..."
            standalone_mode=True,
        )
    except SystemExit as done:
        return int(done.code or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
