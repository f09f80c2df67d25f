"""One vocabulary for the command line (docs/cli.md): an option spelled the same in two commands
has the same type, shape and default there, unless docs/cli.md's per-command table says why it
differs; no concept has two spellings; every command and option docs/cli.md names exists, and
every command and option is in docs/cli.md."""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from tailpilot.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
OPTION = re.compile(r"--[a-z][a-z0-9-]*")

# Spellings that must not name an option a command shows: each concept has one name, the value.
FORBIDDEN = {
    "--optuna-storage": "--storage",
    "--window": "--from/--to",
    "--start": "--from",
    "--since": "--from",
    "--end": "--to",
    "--until": "--to",
    "--cluster-file": "--cluster",
    "--database": "--db",
    "--policies": "--policy",
    "--workers": "--jobs",
    "--db-url": "--db",
    "--store-url": "--db",
    "--recording-name": "--recording",
    "--num-replicas": "--replicas",
    "--replica-name": "--replica",
    "--window-size": "--window-s",
    "--window-seconds": "--window-s",
    "--study-name": "--study",
    "--policy-name": "--policy",
    "--trace-file": "--trace",
    "--output": "--out",
    "--verbose-log": "--verbose",
}
# A spelling forbidden in one command only: there it would be a second name of a shared concept.
FORBIDDEN_IN = {("record", "--name"): "--recording"}


def commands(
    cmd: click.Command = main, path: tuple[str, ...] = ()
) -> Iterator[tuple[str, click.Command]]:
    """(``sub command`` path, command) for every command under ``tailpilot``, groups included."""
    if path:
        yield " ".join(path), cmd
    if isinstance(cmd, click.Group):
        for name, sub in sorted(cmd.commands.items()):
            yield from commands(sub, (*path, name))


COMMANDS = dict(commands())


def long_names(option: click.Option) -> list[str]:
    return [o for o in (*option.opts, *option.secondary_opts) if o.startswith("--")]


def label(option: click.Option) -> str:
    """How docs/cli.md lists an option: ``--store/--no-store`` for a flag pair."""
    return "/".join(long_names(option))


def options_of(command: click.Command, *, hidden: bool = False) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option) and p.hidden == hidden]


def kind(param_type: click.ParamType) -> Any:
    """A comparable description of a parameter type: its class and what bounds it."""
    if isinstance(param_type, click.Choice):
        return ("choice", tuple(param_type.choices))
    if isinstance(param_type, (click.IntRange, click.FloatRange)):
        return (
            type(param_type).__name__,
            param_type.min,
            param_type.max,
            param_type.min_open,
            param_type.max_open,
        )
    if isinstance(param_type, click.Path):
        return ("path", param_type.exists, param_type.file_okay, param_type.dir_okay)
    return type(param_type).__name__


def signature(option: click.Option) -> tuple[Any, ...]:
    """What must agree between two commands' options of one name (help text may differ)."""
    default = option.default if option.default is not click.core.UNSET else None
    return (
        kind(option.type),
        option.multiple,
        option.is_flag,
        default,
        option.metavar,
        tuple(long_names(option)),
    )


def shared_uses() -> dict[str, dict[str, click.Option]]:
    """Option name -> {command: option} for every shown option of every command."""
    uses: dict[str, dict[str, click.Option]] = defaultdict(dict)
    for name, command in COMMANDS.items():
        for option in options_of(command):
            for spelling in long_names(option):
                uses[spelling][name] = option
    return uses


# --- docs/cli.md, parsed --------------------------------------------------------------------------
def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def doc_section(title: str) -> str:
    text = doc_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def table_rows(section: str) -> list[list[str]]:
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def backticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


def documented_differences() -> set[tuple[str, str]]:
    """(option, command) pairs docs/cli.md's per-command table explains."""
    pairs = set()
    for option_cell, command_cell, *_ in table_rows(doc_section("Per-command differences")):
        for option in backticked(option_cell):
            for command in backticked(command_cell):
                pairs.add((option, command))
    return pairs


def documented_old_spellings() -> set[tuple[str, str]]:
    pairs = set()
    for old_cell, command_cell, _ in table_rows(doc_section("Old spellings, still read")):
        for old in backticked(old_cell):
            for command in backticked(command_cell):
                pairs.add((old.split()[0], command))
    return pairs


def documented_commands() -> dict[str, set[str]]:
    """Command -> the options its section lists on its ``Options:`` line."""
    out: dict[str, set[str]] = {}
    sections = re.split(r"\n### `tailpilot ([a-z -]+)`\n", doc_section("Commands"))
    for name, body in zip(sections[1::2], sections[2::2]):
        listed = body[body.index("Options:") :]
        out[name] = set(backticked(listed))
    return out


# --- the checks -------------------------------------------------------------------------------
def test_an_option_means_the_same_everywhere_or_the_docs_say_why_not():
    allowed = documented_differences()
    problems = []
    for spelling, uses in sorted(shared_uses().items()):
        if len(uses) < 2:
            continue
        plain = {c: signature(o) for c, o in uses.items() if (spelling, c) not in allowed}
        if len(set(plain.values())) > 1:
            problems.append(f"{spelling}: {plain}")
        for command in sorted(c for c in uses if (spelling, c) in allowed):
            if plain and signature(uses[command]) in plain.values():
                problems.append(f"{spelling} in {command}: documented as different, but it is not")
    assert problems == [], "\n".join(problems)


def test_every_documented_difference_names_a_real_option_and_its_help_gives_the_default():
    uses = shared_uses()
    for option, command in documented_differences():
        assert command in uses.get(option, {}), f"docs/cli.md: {command} has no {option}"
        param = uses[option][command]
        default = param.default if param.default is not click.core.UNSET else None
        if default is not None and not param.is_flag:
            assert param.show_default or "[default:" in (param.help or ""), (
                f"{command} {option}: its help does not say its default"
            )


def test_no_concept_has_two_spellings():
    shown = [
        (name, spelling)
        for name, command in COMMANDS.items()
        for option in options_of(command)
        for spelling in long_names(option)
    ]
    bad = [
        f"{name} {spelling}: say {FORBIDDEN.get(spelling) or FORBIDDEN_IN[(name, spelling)]}"
        for name, spelling in shown
        if spelling in FORBIDDEN or (name, spelling) in FORBIDDEN_IN
    ]
    assert bad == []


def test_an_old_spelling_is_hidden_and_documented():
    old = {
        (spelling, name)
        for name, command in COMMANDS.items()
        for option in options_of(command, hidden=True)
        for spelling in long_names(option)
    }
    assert old == documented_old_spellings()
    for spelling, name in old:
        assert spelling in FORBIDDEN or (name, spelling) in FORBIDDEN_IN, (name, spelling)


def test_every_command_and_its_options_are_in_the_docs_and_nothing_else_is():
    documented = documented_commands()
    assert set(documented) == set(COMMANDS)
    for name, command in COMMANDS.items():
        shown = {label(o) for o in options_of(command)}
        assert documented[name] == shown, name


def test_every_option_the_docs_name_exists():
    known = {
        spelling
        for command in COMMANDS.values()
        for param in command.params
        for spelling in (*param.opts, *param.secondary_opts)
    }
    named = set(OPTION.findall(doc_text()))
    assert named - known - set(FORBIDDEN) - {"--help"} == set()


def test_every_command_the_docs_name_exists():
    top = set(main.commands)
    for match in re.finditer(r"tailpilot ([a-z][a-z-]*)(?: ([a-z][a-z-]*))?", doc_text()):
        first, second = match.groups()
        assert first in top, match.group(0)
        group = main.commands[first]
        if isinstance(group, click.Group) and second is not None:
            assert second in group.commands, match.group(0)


def test_the_shared_options_are_in_the_vocabulary_table():
    rows = table_rows(doc_section("Vocabulary"))
    documented = {o for row in rows for o in OPTION.findall(row[0])}
    shared = {s for s, uses in shared_uses().items() if len(uses) > 1}
    assert shared - documented == set()


# --- the old spellings still work, and the newcomer's rough edges stay smooth ---------------------
def test_window_is_read_as_from_and_to():
    runner = CliRunner()
    old = runner.invoke(main, ["sim", "--policy", "fcfs", "--window", "10:30", "--json"])
    new = runner.invoke(main, ["sim", "--policy", "fcfs", "--from", "10", "--to", "40", "--json"])
    assert old.exit_code == new.exit_code == 0, old.output + new.output
    first, second = json.loads(old.stdout), json.loads(new.stdout)
    assert first["trace"] == second["trace"] and first["metrics"] == second["metrics"]
    assert "--window is now --from 10 --to 40" in old.stderr
    both = runner.invoke(main, ["sim", "--window", "0:30", "--to", "40"])
    assert both.exit_code == 2 and "give one of them" in both.output


def test_record_name_is_read_as_recording(tmp_path):
    res = CliRunner().invoke(
        main,
        ["record", "--cluster", str(tmp_path / "c.yaml"), "--name", "a", "--recording", "b"],
    )
    assert res.exit_code == 2 and "--name is the old --recording" in res.output


def test_a_recording_is_named_the_same_way_in_every_trace_command():
    for name in ("sim", "compare", "capacity", "twin", "tune"):
        shown = {label(o) for o in options_of(COMMANDS[name])}
        assert {"--recording", "--replica", "--db", "--from", "--to", "--trace"} <= shown, name
    res = CliRunner().invoke(main, ["sim", "--replica", "a"])
    assert res.exit_code == 2 and "--replica goes with --recording" in res.output


def test_replicas_has_one_default():
    defaults = {shared_uses()["--replicas"][c].default for c in ("twin", "demo")}
    assert defaults == {4}


@pytest.mark.parametrize("verbose,level", [(False, logging.WARNING), (True, logging.INFO)])
def test_record_keeps_the_migrations_quiet_unless_verbose(verbose, level):
    from tailpilot.cli_record import configure_logging

    alembic = logging.getLogger("alembic")
    before = alembic.level
    try:
        configure_logging(quiet=False, verbose=verbose)
        assert alembic.level == level
    finally:
        alembic.setLevel(before)


def test_an_old_spelling_is_read_as_the_new_one_with_a_note():
    """compare's --policies is --policy and tune's --workers is --jobs: still read (the value goes
    to the new option, type-checked the same), a note on standard error names the new spelling,
    and the new one wins when both are given."""
    res = CliRunner().invoke(
        main, ["compare", "--policies", "fcfs,sjf", "--baseline", "fcfs", "--to", "30", "--json"]
    )
    assert res.exit_code == 0, res.output
    assert "note: --policies is now --policy fcfs,sjf" in res.stderr
    assert sorted(json.loads(res.stdout)["metrics"]) == ["fcfs", "sjf"]
    plain = CliRunner().invoke(
        main, ["compare", "--policy", "fcfs", "--baseline", "fcfs", "--to", "30", "--json"]
    )
    assert plain.exit_code == 0 and "note:" not in plain.stderr  # only the old spelling notes
    tune = COMMANDS["tune"]
    assert tune.make_context("tune", ["--study", "s", "--workers", "3"]).params["jobs"] == 3
    both = tune.make_context("tune", ["--study", "s", "--workers", "3", "--jobs", "2"])
    assert both.params["jobs"] == 2
    bad = CliRunner().invoke(main, ["tune", "--study", "s", "--workers", "0"])
    assert bad.exit_code == 2 and "--jobs" in bad.output and "x>=1" in bad.output


@pytest.mark.parametrize(
    "error, code",
    [("storage.database:StoreWriteError", 1), ("sim.traces:TraceError", 2)],
)
def test_an_error_a_command_lets_through_ends_it_with_its_exit_code(error, code):
    """Every error class derives from scheduler.errors.TailpilotError (tests/test_layers.py); one
    that no command turned into a usage error ends the command with one line and its exit code
    (docs/cli.md, "Exit status"), never a traceback."""
    import importlib

    from tailpilot.cli import TailpilotGroup

    module, name = error.split(":")
    cls = getattr(importlib.import_module(module), name)
    group = TailpilotGroup()

    @group.command()
    def boom() -> None:
        raise cls("the disk is full")

    res = CliRunner().invoke(group, ["boom"])
    assert res.exit_code == code and res.stderr == "Error: the disk is full\n"
    assert isinstance(res.exception, SystemExit)


def test_the_governor_and_the_autopilot_have_one_command_shape():
    """``tailpilot governor|autopilot ACTION``: the same actions with the same options (the
    governor's disarm adds --keep), built from one vocabulary (storage.control)."""
    from storage.control import CONTROL_ACTIONS

    def shape(group: str) -> dict[str, set[str]]:
        cmds = main.commands[group].commands  # type: ignore[attr-defined]
        return {
            name: {o for p in cmd.params for o in p.opts}
            for name, cmd in cmds.items()
            if name in CONTROL_ACTIONS
        }

    governor, autopilot = shape("governor"), shape("autopilot")
    assert set(governor) == set(autopilot) == set(CONTROL_ACTIONS)
    assert set(main.commands["governor"].commands) == set(CONTROL_ACTIONS)  # type: ignore[attr-defined]
    for action in CONTROL_ACTIONS:
        extra = {"--keep"} if action == "disarm" else set()
        assert governor[action] == autopilot[action] | extra, action
