"""The option vocabulary: one definition of every option that several ``tailpilot`` commands take.

An option spelled the same in two commands means the same thing there, with the same type and
default (docs/cli.md lists them; tests/test_cli_vocabulary.py walks every command and checks).
A command passes its own ``help`` where the same meaning reads better in its words ("the cluster
it runs on"); the few per-command defaults (``--policy`` of ``sim``, ``twin`` and ``capacity``,
``--window-s`` of ``tune``, ...) are parameters here, and docs/cli.md and the help text give each
one's reason.

    @click.command()
    @options.cluster_file()
    @options.cluster_name()
    @options.database()
    @options.json_output("the state")
    def status(cluster_file: str, cluster_name: str | None, db: str | None, as_json: bool): ...
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from tailpilot.cli_common import (
    AUDIT_NAME,
    FILE,
    GPU_BLOCKS,
    OUT_FILE,
    POLICY,
    POLICY_LIST,
    POSITIVE,
    REPLICA_COUNT,
    SECONDS_INTO,
    SEED,
    STEP_MODEL,
    TENANTS,
    TOKENS,
    WINDOW_LENGTH,
)

# What an option factory returns: a decorator adding the option to a command's callback.
Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]

DB_ENV = "TAILPILOT_DB"  # the database when --db is not given (else ./tailpilot.db)
DEFAULT_REPLICAS = 4  # twin and demo: enough replicas that policies side by side all show
DEFAULT_WINDOW_S = 60.0  # the cluster file's default window (controlplane.cluster)


def stack(*decorators: Decorator) -> Decorator:
    """Several option decorators as one, applied in the order given (the first is the first in
    ``--help``)."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for decorator in reversed(decorators):
            fn = decorator(fn)
        return fn

    return decorate


def shows(default: object, help: str) -> bool:
    """Whether click should add ``[default: ...]``: not when there is none, nor when the help
    already gives it with its reason (a per-command default)."""
    return default is not None and "[default:" not in help


# --- clusters, databases, studies -----------------------------------------------------------------
def cluster_file(
    *, required: bool = True, help: str = "Cluster file (YAML) listing the replicas."
) -> Decorator:
    """``--cluster FILE``: a cluster file, always a file (a cluster by name is --cluster-name)."""
    return click.option(
        "--cluster", "cluster_file", required=required, type=FILE, metavar="FILE", help=help
    )


def cluster_name(
    *,
    help: str = "Which cluster of the file (needed when it has several).",
    default: str | None = None,
) -> Decorator:
    """``--cluster-name NAME``: a cluster by name: which cluster of the --cluster file, or,
    without one, of the database. ``default``: only ``twin``, which names the cluster it makes."""
    return click.option(
        "--cluster-name",
        default=default,
        show_default=shows(default, help),
        metavar="NAME",
        help=help,
    )


def database(
    *,
    help: str = f"tailpilot's database: SQLite path or URL [default: ${DB_ENV}, else "
    "./tailpilot.db].",
    default: str | None = None,
) -> Decorator:
    """``--db URL``: tailpilot's database (recordings, audit log, recommendations). ``default``:
    only ``demo``, which keeps its own database apart from a real one."""
    return click.option(
        "--db", default=default, show_default=shows(default, help), metavar="URL", help=help
    )


def optuna_storage(
    *,
    help: str = "Optuna storage of the studies: RDB URL, SQLite path or journal:PATH "
    "[default: ./tailpilot-optuna.db].",
) -> Decorator:
    """``--storage URL``: where the tuner's studies live (never tailpilot's own --db)."""
    return click.option("--storage", metavar="URL", help=help)


def study(*, required: bool = True, help: str = "Study name.") -> Decorator:
    return click.option("--study", "study_name", required=required, metavar="NAME", help=help)


def who(*, help: str = "Name in the audit log [default: $USER].") -> Decorator:
    return click.option("--who", type=AUDIT_NAME, default=None, metavar="NAME", help=help)


def json_output(what: str) -> Decorator:
    """``--json``: print ``what`` as strict JSON on standard output instead of text."""
    return click.option("--json", "as_json", is_flag=True, help=f"Print {what} as JSON.")


def readonly(
    *, help: str = "Watch only: every action that changes the cluster is disabled."
) -> Decorator:
    return click.option("--readonly", is_flag=True, help=help)


def keep_result(
    *, help: str = "Keep the result in the database (the TUI shows it).", dest: str = "keep"
) -> Decorator:
    """``--store/--no-store``: whether a command that computes a report keeps it in --db."""
    return click.option("--store/--no-store", dest, default=True, show_default=True, help=help)


def out_file(*, help: str = "Write here instead of standard output.") -> Decorator:
    return click.option("--out", type=OUT_FILE, metavar="FILE", help=help)


def progress() -> Decorator:
    return click.option(
        "--progress/--no-progress", default=None, help="Progress bar [default: on a terminal]."
    )


# --- replicas and policies ------------------------------------------------------------------------
def replica(
    *,
    several: bool = True,
    required: bool = False,
    help: str = "A replica, by its name in the cluster (repeatable).",
) -> Decorator:
    """``--replica NAME``: a replica by name; repeatable where a command takes several (its
    parameter is then ``replicas``, a tuple), once where it works on one (``replica``)."""
    return click.option(
        "--replica",
        "replicas" if several else "replica",
        multiple=several,
        required=required,
        metavar="NAME",
        help=help,
    )


def replica_count(*, help: str = "Twin replicas to start (twin-0, twin-1, ...).") -> Decorator:
    """``--replicas N`` (``-n N``): how many simulated replicas to start (``n_replicas``; a
    command's ``replicas`` are names, of --replica)."""
    return click.option(
        "--replicas",
        "-n",
        "n_replicas",
        type=REPLICA_COUNT,
        metavar="N",
        default=DEFAULT_REPLICAS,
        show_default=True,
        help=help,
    )


def policy(*, default: str | None = None, help: str) -> Decorator:
    """``--policy NAME``: one scheduling policy. A command with a default says why in ``help``
    (docs/cli.md: sim, twin and capacity)."""
    return click.option(
        "--policy", type=POLICY, default=default, show_default=shows(default, help), help=help
    )


def policies(*, default: str | None = None, help: str) -> Decorator:
    """``--policy NAME[,NAME]``: several policies (the ones a study searches, the ones ``compare``
    runs). One option for one policy or several: ``--policies`` is compare's old spelling
    (:func:`renamed`)."""
    return click.option(
        "--policy",
        "policies",
        type=POLICY_LIST,
        default=default,
        show_default=shows(default, help),
        metavar="NAME[,NAME]",
        help=help,
    )


def jobs(*, help: str) -> Decorator:
    """``--jobs N``: local worker processes (compare's policies, tune's Optuna workers);
    ``--workers`` is tune's old spelling (:func:`renamed`)."""
    return click.option(
        "--jobs", type=click.IntRange(min=1), metavar="N", default=1, show_default=True, help=help
    )


def renamed(old: str, new: str, dest: str) -> Decorator:
    """An old spelling, still read (docs/cli.md, "Old spellings"): hidden from ``--help``; given,
    a note names the new one on standard error and its value becomes ``new``'s (parameter
    ``dest``) unless ``new`` is given too. Click processes the options given before those not
    given, so ``new``, not given, then takes it as its default (type-checked as if given)."""

    def forward(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is None:
            return
        click.echo(f"note: {old} is now {new} {value} (docs/cli.md)", err=True)
        ctx.default_map = {**(ctx.default_map or {}), dest: value}

    # A name of its own: sharing ``dest``, the parser would hand it ``new``'s value too.
    return click.option(
        old, f"old_{dest}", hidden=True, expose_value=False, callback=forward, metavar="VALUE"
    )


def assignments(
    *,
    metavar: str = "NAME=VALUE",
    help: str = "Set a policy parameter (repeatable).",
) -> Decorator:
    return click.option("--set", "assignments", multiple=True, metavar=metavar, help=help)


def pins(*, help: str = "Pin a parameter: adaptation leaves it alone (repeatable).") -> Decorator:
    return click.option("--pin", "pins", multiple=True, metavar="NAME", help=help)


def settings_file(*, help: str) -> Decorator:
    return click.option("--settings", "settings_file", type=FILE, metavar="FILE", help=help)


def speed(
    *, help: str = "Replica clock speed (10 = ten simulated seconds per wall second)."
) -> Decorator:
    return click.option(
        "--speed", type=POSITIVE, default=1.0, show_default=True, metavar="X", help=help
    )


def autopilot(*, help: str, dest: str = "autopilot") -> Decorator:
    return click.option("--autopilot", dest, is_flag=True, help=help)


# --- traces and time ------------------------------------------------------------------------------
def trace(*, several: bool = False, help: str | None = None) -> Decorator:
    """``--trace FILE``: a trace file (any supported format) or a recording's ``db:`` URL;
    ``several``: a comma-separated list (``tune``, ``autopilot tune``)."""
    text = help or (
        "Trace file (any supported format), or a recording as "
        "db:[STORE]#recording=NAME[&replicas=R][&from=S&to=S]; default: the bundled Azure conv "
        "window."
    )
    if several:
        return click.option("--trace", "trace_paths", metavar="FILE[,FILE]", help=text)
    return click.option("--trace", "trace_path", metavar="FILE", help=text)


def recording(
    *, help: str = "Replay a recording of the cluster's own traffic (in --db)."
) -> Decorator:
    return click.option("--recording", metavar="NAME", help=help)


def span_bounds(*, what: str = "the trace") -> Decorator:
    """``--from SECONDS`` and ``--to SECONDS``: a part of ``what``, in seconds from its first
    arrival (the ``from``/``to`` of a ``db:`` URL)."""
    return stack(
        click.option(
            "--from",
            "start_s",
            type=SECONDS_INTO,
            metavar="SECONDS",
            help=f"Keep arrivals from this many seconds into {what} [default: its start].",
        ),
        click.option(
            "--to",
            "end_s",
            type=SECONDS_INTO,
            metavar="SECONDS",
            help="... and before this many seconds into it [default: its end].",
        ),
    )


def window_length(*, default: float = DEFAULT_WINDOW_S, help: str) -> Decorator:
    """``--window-s SECONDS``: the length of the windows a trace is judged in. ``default``: 60 s
    (a cluster file's window), 120 s for ``tune`` (docs/cli.md says why)."""
    return click.option(
        "--window-s",
        type=WINDOW_LENGTH,
        default=default,
        show_default=shows(default, help),
        metavar="SECONDS",
        help=help,
    )


def rate_scale(*, help: str = "Multiply the trace's arrival rate by X.") -> Decorator:
    return click.option("--rate-scale", type=POSITIVE, metavar="X", help=help)


def target_rate() -> Decorator:
    return click.option(
        "--target-rate",
        type=POSITIVE,
        metavar="REQ_PER_S",
        help="Rescale arrivals to this rate (a trace of lengths only: Poisson arrivals at it).",
    )


def max_tokens_cap() -> Decorator:
    return click.option(
        "--max-tokens-cap",
        "cap",
        type=TOKENS,
        metavar="N",
        help="Cap every request's output at N tokens.",
    )


def max_tokens_default() -> Decorator:
    return click.option(
        "--max-tokens-default",
        type=TOKENS,
        metavar="N",
        help="max_tokens of requests whose trace records no cap (longer outputs are truncated to "
        "it) [default: 4096].",
    )


def tenants() -> Decorator:
    return click.option(
        "--tenants", type=TENANTS, metavar="N", help="Assign N Zipf-distributed tenants."
    )


def num_gpu_blocks() -> Decorator:
    return click.option(
        "--num-gpu-blocks",
        type=GPU_BLOCKS,
        metavar="N",
        help="KV cache size in blocks of 16 tokens [default: 25,000].",
    )


def seed(*, help: str = "Seed for generated arrivals and tenants.") -> Decorator:
    return click.option("--seed", type=SEED, default=0, show_default=True, metavar="N", help=help)


def step_model(
    *, help: str = "Step-time coefficient set [default: a100-80gb/llama-3-8b/tp1]."
) -> Decorator:
    return click.option("--step-model", type=STEP_MODEL, metavar="NAME", help=help)


def trials(*, default: int, maximum: int | None = None, help: str) -> Decorator:
    return click.option(
        "--trials",
        type=click.IntRange(1, maximum),
        default=default,
        show_default=True,
        metavar="N",
        help=help,
    )
