"""``python -m tui``: the TUI without the ``tailpilot`` CLI (the options of ``tailpilot tui``).

    python -m tui --cluster clusters.yaml [--cluster-name NAME] [--db URL] [--readonly]
    python -m tui --replay recording.db [--cluster-name NAME] [--cluster clusters.yaml (for its SLOs)]
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m tui")
    p.add_argument("--cluster", help="cluster file (YAML)")
    p.add_argument("--cluster-name", default=None)
    p.add_argument("--db", default=None, help="store URL or SQLite path")
    p.add_argument("--readonly", action="store_true")
    p.add_argument("--replay", default=None, help="a recording (SQLite file or URL) to replay")
    a = p.parse_args(argv)
    from controlplane.cluster import ClusterFileError, load_cluster_file
    from tui.main import run_tui

    cluster = None
    if a.cluster:
        try:
            cluster = load_cluster_file(a.cluster).cluster(a.cluster_name)
        except (ClusterFileError, KeyError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    if cluster is None and a.replay is None:
        p.error("give --cluster FILE or --replay FILE.db")
    from storage.store import StoreError
    from tui.sources import ReplayError

    try:
        run_tui(cluster, db_url=a.db, readonly=a.readonly, replay=a.replay, cluster_name=a.cluster_name)
    except (ReplayError, StoreError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
