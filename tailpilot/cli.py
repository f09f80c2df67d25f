"""The ``tailpilot`` command line: the group every command belongs to, and ``schema``.

    tailpilot --help                     # every command
    tailpilot sim --policy uniboost --set gamma=0.05 --json

The commands live by what they work on (``tailpilot/__init__.py`` lists the modules); their
options follow one vocabulary (``tailpilot.options``, docs/cli.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from scheduler.errors import TailpilotError
from tailpilot import cli_cluster, cli_export, cli_loop, cli_record, cli_sim, cli_tune, cli_twin
from tailpilot.cli_common import OUT_FILE, json_text


class TailpilotGroup(click.Group):
    """The ``tailpilot`` group: an error tailpilot raises on purpose (``scheduler.errors``) that a
    command lets through — a store that fails mid-command (a damaged file, a lock held too long),
    a replica's unreadable answer — ends the command with a one-line error and the error's exit
    code (docs/cli.md, "Exit status") instead of a traceback, whichever command it was."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TailpilotError as err:
            # As click prints its own errors ("Error: ..." on standard error), with this exit code.
            click.echo(f"Error: {err}", err=True)
            ctx.exit(err.exit_code)


@click.group(cls=TailpilotGroup)
@click.version_option(package_name="tailpilot")
def main() -> None:
    """tailpilot: tail-aware scheduling for vLLM clusters."""


@main.command()
@click.option(
    "--out", type=OUT_FILE, metavar="FILE", help="Write the schema here instead of printing it."
)
def schema(out: str | None) -> None:
    """The JSON Schema of every control-API document (state, completion, steps, settings, error):
    what the plugin and the twins send and the collector reads (scheduler/contract.py)."""
    from scheduler.contract import json_schema  # start-up cost

    text = json_text(json_schema(), sort_keys=True, ensure_ascii=False) + "\n"
    if out:
        Path(out).write_text(text, encoding="utf-8")
    else:
        click.echo(text, nl=False)


for _module in (cli_sim, cli_twin, cli_cluster, cli_record, cli_tune, cli_export, cli_loop):
    for _command in _module.COMMANDS:
        main.add_command(_command)

if __name__ == "__main__":  # pragma: no cover
    main()
