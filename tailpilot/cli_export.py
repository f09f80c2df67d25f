"""``tailpilot export`` and ``tailpilot calibrate``.

    tailpilot export --settings tuned.json --format vllm-args \\
        --model meta-llama/Meta-Llama-3-8B-Instruct
    tailpilot export --study prod-nightly --db sqlite:///tailpilot.db --format configmap \\
        --name tp --out cm.yaml
    tailpilot export --study prod-nightly --format helm \\
        --model meta-llama/Meta-Llama-3-8B-Instruct --out values.yaml
    tailpilot export --cluster clusters.yaml --format prometheus-rules --out tailpilot-rules.yaml
    tailpilot export --cluster clusters.yaml --format grafana --out tailpilot-dashboard.json
    tailpilot calibrate --db sqlite:///tailpilot.db --replica a100-0 [--cluster-name prod] \\
        [--name calibrated/a100]
    tailpilot calibrate --url http://10.0.0.7:8765 --name calibrated/a100-0

Thin layers over ``controlplane.export`` and ``tuner.closed_loop.calibrate``. Exit status: 0 on
success, 1 when a replica cannot be reached or the step log cannot be fitted, 2 for bad input
(click's usage errors: an invalid settings file, an unknown study or replica, conflicting
options).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import click

from tailpilot import options
from tailpilot.cli_cluster import load_cluster, open_store
from tailpilot.cli_common import POSITIVE, FiniteFloatRange, KeyValue, echo_json

if TYPE_CHECKING:  # the library's modules load only when a command runs (start-up cost)
    from scheduler.settings import Settings
    from sim.stepmodel import StepTimeModel

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
@click.command()
@options.settings_file(help="A settings JSON file (the document the plugin reads at start-up).")
@options.study(
    required=False, help="Export the newest recommendation of this study (tailpilot recommend)."
)
@options.database(
    help="tailpilot's database, where `tailpilot recommend` stored the recommendation "
    f"[default: ${options.DB_ENV}, else ./tailpilot.db]."
)
@options.optuna_storage(
    help="The study's Optuna storage, as given to tune/recommend; only used in the hint when no "
    "recommendation is stored yet (export reads the stored recommendation, never Optuna)."
)
@options.cluster_file(
    required=False,
    help="prometheus-rules, prometheusrule, grafana, servicemonitor: the cluster file (its "
    "thresholds).",
)
@options.cluster_name()
@click.option(
    "--format",
    "fmt",
    type=click.Choice(
        [
            "settings",
            "vllm-args",
            "configmap",
            "helm",
            "prometheus-rules",
            "prometheusrule",
            "grafana",
            "servicemonitor",
        ]
    ),
    default="settings",
    show_default=True,
    help="What to write.",
)
@options.out_file(help="Write here (atomically) instead of standard output.")
@click.option(
    "--model", default="MODEL", show_default=True, help="vllm-args, helm: the model vLLM serves."
)
@click.option(
    "--scheduler",
    type=click.Choice(["async", "sync"]),
    default="async",
    show_default=True,
    help="Plugin class: async = TailpilotAsyncScheduler (vLLM's GPU default), sync = "
    "TailpilotScheduler (async scheduling off, CPU).",
)
@click.option(
    "--settings-path",
    default="tailpilot-settings.json",
    show_default=True,
    metavar="PATH",
    help="vllm-args: the settings file TAILPILOT_SETTINGS_FILE names.",
)
@click.option(
    "--name",
    default="tailpilot-settings",
    show_default=True,
    metavar="NAME",
    help="configmap, helm: the ConfigMap's name.",
)
@click.option("--namespace", help="configmap, prometheusrule, servicemonitor: metadata.namespace.")
@click.option(
    "--image",
    default="vllm/vllm-openai:latest",
    show_default=True,
    help="helm: the vLLM image (it must have tailpilot installed).",
)
@click.option(
    "--replica-count",
    type=click.IntRange(1),
    metavar="N",
    default=1,
    show_default=True,
    help="helm: the chart's replicaCount (vLLM replicas deployed).",
)
@click.option("--engine-name", default="llm", show_default=True, help="helm: modelSpec name.")
@click.option(
    "--api-port",
    type=click.IntRange(1, 65535),
    metavar="PORT",
    default=8765,
    show_default=True,
    help="helm: the control API's port in each pod.",
)
@click.option(
    "--token-secret",
    metavar="SECRET",
    help="helm: a Secret with TAILPILOT_TOKEN, loaded as env vars.",
)
@click.option(
    "--service-monitor/--no-service-monitor",
    default=False,
    show_default=True,
    help="helm: have the chart create a ServiceMonitor for the engines' /metrics (needs the "
    "Prometheus Operator's CRDs in the cluster).",
)
@click.option(
    "--label",
    "labels",
    multiple=True,
    type=KeyValue("KEY=VALUE", "release=kube-prometheus-stack"),
    metavar="KEY=VALUE",
    help="prometheusrule, servicemonitor: an extra metadata label, e.g. "
    "release=kube-prometheus-stack (repeatable).",
)
@click.option(
    "--interval",
    default="15s",
    show_default=True,
    metavar="DURATION",
    help="helm, servicemonitor: the scrape interval.",
)
@click.option(
    "--for",
    "for_",
    metavar="DURATION",
    help="prometheus-rules: how long a governance figure stays below its threshold before its "
    "alert fires (default: the cluster file's alerts.for_s, as the recorder's own alerts).",
)
def export(
    settings_file: str | None,
    study_name: str | None,
    db: str | None,
    storage: str | None,
    cluster_file: str | None,
    cluster_name: str | None,
    fmt: str,
    out: str | None,
    model: str,
    scheduler: str,
    settings_path: str,
    name: str,
    namespace: str | None,
    image: str,
    replica_count: int,
    engine_name: str,
    api_port: int,
    token_secret: str | None,
    service_monitor: bool,
    labels: tuple[tuple[str, str], ...],
    interval: str,
    for_: str | None,
) -> None:
    """Write settings for deployment — the plugin's settings JSON, a `vllm serve` command line,
    a Kubernetes ConfigMap or Helm values for the vLLM production-stack chart — or a cluster's
    monitoring: Prometheus alert rules at its thresholds, a Grafana dashboard, a ServiceMonitor for
    the recorder. Every output is parsed back and checked before it is written."""
    from controlplane.export import ExportError, ExportOptions, render  # start-up cost
    from controlplane.monitoring import FORMATS as MONITORING_FORMATS  # start-up cost

    if fmt in MONITORING_FORMATS:
        if settings_file or study_name:
            raise click.UsageError(
                f"--format {fmt} exports a cluster's monitoring: give --cluster FILE, "
                "not --settings or --study"
            )
        _export_monitoring(cluster_file, cluster_name, fmt, out, namespace, interval, for_, labels)
        return
    if cluster_file:
        raise click.UsageError(
            f"--cluster goes with --format {', '.join(MONITORING_FORMATS)}; "
            f"{fmt} exports settings (--settings or --study)"
        )
    if fmt == "helm":
        _check_interval(interval)
    try:  # Kubernetes names and the image, checked before anything is read or written
        export_options = ExportOptions(
            model=model,
            scheduler=scheduler,
            settings_path=settings_path,
            name=name,
            namespace=namespace,
            source=None,
            engine_name=engine_name,
            image=image,
            replicas=replica_count,
            api_port=api_port,
            token_secret=token_secret,
            service_monitor=service_monitor,
            scrape_interval=interval,
        )
    except ExportError as err:
        raise click.UsageError(str(err)) from None
    settings, source = _settings_to_export(settings_file, study_name, db, storage)
    export_options = dataclasses.replace(export_options, source=source)
    try:
        text = render(settings, fmt, export_options)
    except ExportError as err:
        raise click.ClickException(str(err)) from None
    _write(text, out, f"{fmt} for {settings.policy} ({source})")
    if fmt == "vllm-args":
        click.echo(
            f"(write the settings file it names with: tailpilot export ... --format settings "
            f"--out {settings_path})",
            err=True,
        )


def _settings_to_export(
    settings_file: str | None, study_name: str | None, db: str | None, storage: str | None
) -> tuple[Settings, str]:
    """(the settings document, where it came from) of --settings or --study."""
    from controlplane.export import (  # start-up cost
        ExportError,
        NoRecommendation,
        load_settings_file,
        settings_from_study,
    )

    if bool(settings_file) == bool(study_name):
        raise click.UsageError("give exactly one of --settings FILE and --study NAME")
    try:
        if settings_file:
            return load_settings_file(settings_file), f"file {Path(settings_file).name}"
        assert study_name is not None  # exactly one of the two was given
        from tuner.studies.lookup import check_study_name  # start-up cost (optuna)
        from tuner.studies.optuna_storage import TuneError  # start-up cost (optuna)

        try:
            check_study_name(study_name)
        except TuneError as err:
            shown = str(err).removeprefix("--study ")
            raise click.BadParameter(shown, param_hint="--study") from None
        store = open_store(db, must_exist=True)
        try:
            try:
                settings, rec = settings_from_study(store, study_name, storage=storage, db=db)
            except NoRecommendation:
                # No recommendation: if the study itself does not exist, `recommend` would fail
                # too — say that, with the studies there are, instead of pointing to it.
                missing = _missing_study(study_name, storage)
                if missing is not None:
                    raise click.UsageError(missing) from None
                raise
        finally:
            store.close()
        return settings, f"study {study_name}, recommendation #{rec.id}"
    except ExportError as err:
        raise click.UsageError(str(err)) from None
    except RecursionError:  # JSON nested past Python's recursion limit (export lets it through)
        raise click.UsageError(
            f"{settings_file or study_name}: not JSON: nested too deeply"
        ) from None


def _missing_study(study: str, storage: str | None) -> str | None:
    """Why ``study`` is not in the Optuna storage (the studies there, how to create it), None
    when it is there or the storage cannot say. Only a storage in a local file is looked at: a
    database server is never contacted by export (it may be unreachable from here)."""
    from tuner.studies.lookup import missing_study_message  # start-up cost (optuna)
    from tuner.studies.optuna_storage import JOURNAL_PREFIX, TuneError, storage_url  # start-up cost

    try:
        url = storage_url(storage)
        if not url.startswith(("sqlite:", JOURNAL_PREFIX)):
            return None
        return missing_study_message(url, study)
    except TuneError as err:
        return str(err)


def _checked(check: Callable[[T], object], value: T, hint: str) -> None:
    """``check(value)``, its MonitoringExportError ("field: problem") as a usage error on
    ``hint``."""
    from controlplane.monitoring import MonitoringExportError  # start-up cost

    try:
        check(value)
    except MonitoringExportError as err:
        raise click.BadParameter(str(err).split(": ", 1)[1], param_hint=hint) from None


def _check_interval(interval: str) -> None:
    from controlplane.monitoring import check_duration  # start-up cost

    _checked(lambda v: check_duration(v, "interval"), interval, "--interval")


def _write(text: str, out: str | None, what: str) -> None:
    from controlplane.export import write_atomically  # start-up cost

    if out:
        try:
            write_atomically(out, text)
        except OSError as err:
            raise click.ClickException(f"cannot write {out}: {err.strerror or err}") from None
        click.echo(f"wrote {what} to {out}", err=True)
    else:
        click.echo(text, nl=False)


def _export_monitoring(
    cluster_file: str | None,
    cluster_name: str | None,
    fmt: str,
    out: str | None,
    namespace: str | None,
    interval: str,
    for_: str | None,
    labels: tuple[tuple[str, str], ...],
) -> None:
    from controlplane.monitoring import (  # start-up cost
        MonitoringExportError,
        check_duration,
        check_labels,
        render,
    )

    if not cluster_file:
        raise click.UsageError(
            f"--format {fmt} needs --cluster FILE (the cluster file with its thresholds)"
        )
    cluster = load_cluster(cluster_file, cluster_name)
    if for_ is not None:
        _checked(lambda v: check_duration(v, "for"), for_, "--for")
    _check_interval(interval)
    extra = dict(labels)
    _checked(check_labels, extra, "--label")
    try:
        text = render(cluster, fmt, namespace=namespace, for_=for_, interval=interval, labels=extra)
    except MonitoringExportError as err:
        raise click.ClickException(str(err)) from None
    governed = "governed" if cluster.governance is not None else "not governed: replica alerts only"
    _write(text, out, f"{fmt} for cluster {cluster.name} ({governed})")


# --------------------------------------------------------------------------------------------
@click.command()
@options.database(
    help=f"Store that knows the replica [default: ${options.DB_ENV}, else ./tailpilot.db]."
)
@options.replica(several=False, help="The replica to calibrate on, as named in the store.")
@options.cluster_name(help="Its cluster (needed when the name is in several).")
@click.option(
    "--url",
    metavar="URL",
    help="Calibrate straight from this control API instead (http://host:port).",
)
@click.option(
    "--name",
    "set_name",
    metavar="NAME",
    help="Name of the coefficient set to save [default: calibrated/<replica>].",
)
@click.option(
    "--min-steps",
    type=click.IntRange(5),
    metavar="N",
    default=50,
    show_default=True,
    help="Refuse to fit fewer usable steps than this.",
)
@click.option(
    "--holdout",
    type=FiniteFloatRange(0, 0.5),
    metavar="FRACTION",
    default=0.2,
    show_default=True,
    help="Fraction of steps held out to measure the error on unseen steps.",
)
@click.option(
    "--base",
    metavar="NAME",
    help="Keep this set's values for terms the log cannot determine (default: refuse such a log).",
)
@click.option(
    "--timeout",
    type=POSITIVE,
    default=10.0,
    show_default=True,
    metavar="SECONDS",
    help="Seconds per HTTP request.",
)
@click.option(
    "--save/--no-save",
    default=True,
    show_default=True,
    help="Save the set where --step-model finds it.",
)
@click.option(
    "--overwrite/--no-overwrite",
    default=True,
    show_default=True,
    help="Replace a saved set of the same name.",
)
@click.option(
    "--error",
    type=click.Choice(["absolute", "relative"]),
    default="absolute",
    show_default=True,
    help="The loss: absolute error keeps long steps' share of the total (what queues feel); "
    "relative weighs every step alike. Either way the fit is scaled to the recorded total.",
)
@options.json_output("the result")
def calibrate(
    db: str | None,
    replica: str | None,
    cluster_name: str | None,
    url: str | None,
    set_name: str | None,
    min_steps: int,
    holdout: float,
    base: str | None,
    timeout: float,
    save: bool,
    overwrite: bool,
    error: str,
    as_json: bool,
) -> None:
    """Fit the step-time model's coefficients to a live replica's step log, report the fit error
    (also on held-out steps) and save them as a named coefficient set for the simulator and the
    tuner (--step-model NAME)."""
    from sim.stepmodel import save_user_model  # start-up cost
    from tuner.closed_loop.calibrate import calibrate_steps, format_report  # start-up cost
    from tuner.closed_loop.replica_facts import (
        CalibrationError,
        ReplicaUnreachable,
        fetch_engine_facts,
        fetch_step_log,
    )  # start-up cost

    if url and (replica or db or cluster_name):
        raise click.UsageError("give either --url or --replica (with --db), not both")
    if not url and not replica:
        raise click.UsageError("give --replica NAME (looked up in the store) or --url URL")
    base_model = _base_model(base)
    _check_set_name(set_name)
    control_url, where = _control_api(url, db, replica, cluster_name)
    try:
        reported_name, steps = fetch_step_log(control_url, timeout=timeout)
    except ReplicaUnreachable as err:
        raise click.ClickException(f"{replica or url} is unreachable: {err}") from None
    name = set_name or f"calibrated/{replica or reported_name or 'replica'}"
    _check_set_name(name)
    try:
        result = calibrate_steps(
            steps,
            name=name,
            source=f"calibrated on {where}",
            min_steps=min_steps,
            holdout=holdout,
            base=base_model,
            error=error,
        )
    except CalibrationError as err:
        raise click.ClickException(f"{where}: {err}") from None
    try:
        result.engine = fetch_engine_facts(control_url, timeout=timeout)
    except ReplicaUnreachable as err:
        result.warnings.append(
            f"engine facts not read ({err}); replays keep the simulator's defaults"
        )
    saved = None
    if save:
        try:
            saved = str(save_user_model(result.model, overwrite=overwrite))
        except (ValueError, OSError) as err:
            raise click.ClickException(f"cannot save {name!r}: {err}") from None
    if as_json:
        echo_json({**result.as_dict(), "saved_to": saved}, default=float)
    else:
        click.echo(format_report(result, saved))
    sys.stdout.flush()


def _base_model(base: str | None) -> StepTimeModel | None:
    """The coefficient set --base names (None without one)."""
    from sim.stepmodel import get_model  # start-up cost

    if not base:
        return None
    try:
        return get_model(base)
    except ValueError as err:
        raise click.BadParameter(str(err), param_hint="--base") from None


def _check_set_name(set_name: str | None) -> None:
    """BadParameter on --name for an empty name or a built-in set's."""
    from sim.stepmodel import COEFFICIENT_SETS  # start-up cost

    if set_name is not None and not set_name.strip():
        raise click.BadParameter("must not be empty", param_hint="--name")
    if set_name in COEFFICIENT_SETS:
        raise click.BadParameter(
            f"{set_name!r} is a built-in coefficient set; choose another name", param_hint="--name"
        )


def _control_api(
    url: str | None, db: str | None, replica: str | None, cluster_name: str | None
) -> tuple[str, str]:
    """(the control API to read, how the report names it): --url, or the replica's in --db."""
    from tuner.closed_loop.replica_facts import (  # start-up cost
        CalibrationError,
        replica_control_url,
    )

    if url:
        return url, url
    assert replica is not None  # calibrate refused neither --url nor --replica
    store = open_store(db, must_exist=True)
    try:
        cluster, control_url = replica_control_url(store, replica, cluster_name)
    except CalibrationError as err:
        raise click.BadParameter(str(err), param_hint="--replica") from None
    finally:
        store.close()
    return control_url, f"replica {replica} of cluster {cluster} ({control_url})"


COMMANDS: tuple[click.Command, ...] = (export, calibrate)
