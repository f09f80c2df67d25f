"""``tailpilot export`` and ``tailpilot calibrate``.

    tailpilot export --settings tuned.json --format vllm-args --model meta-llama/Meta-Llama-3-8B-Instruct
    tailpilot export --study prod-nightly --db sqlite:///tailpilot.db --format configmap --name tp --out cm.yaml
    tailpilot export --study prod-nightly --format helm --model meta-llama/Meta-Llama-3-8B-Instruct --out values.yaml
    tailpilot export --cluster clusters.yaml --format prometheus-rules --out tailpilot-rules.yaml
    tailpilot export --cluster clusters.yaml --format grafana --out tailpilot-dashboard.json
    tailpilot calibrate --db sqlite:///tailpilot.db --replica a100-0 [--cluster-name prod] [--name calibrated/a100]
    tailpilot calibrate --url http://10.0.0.7:8765 --name calibrated/a100-0

Thin layers over ``controlplane.export`` and ``tuner.calibrate``. Exit status: 0 on success, 1 when
a replica cannot be reached or the step log cannot be fitted, 2 for bad input (click's usage
errors: an invalid settings file, an unknown study or replica, conflicting options).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from tailpilot.cli_cluster import DB_ENV, open_store
from tailpilot.cli_common import POSITIVE, FiniteFloatRange, echo_json


# --------------------------------------------------------------------------------------------
@click.command()
@click.option(
    "--settings",
    "settings_file",
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="A settings JSON file (the document the plugin reads at start-up).",
)
@click.option(
    "--study",
    metavar="NAME",
    help="Export the newest recommendation of this study (tailpilot recommend).",
)
@click.option(
    "--db",
    metavar="URL",
    help=f"tailpilot's database, where `tailpilot recommend` stored the recommendation "
    f"(default ${DB_ENV} or ./tailpilot.db).",
)
@click.option(
    "--storage",
    metavar="URL",
    help="The study's Optuna storage, as given to tune/recommend; only used in the hint when no "
    "recommendation is stored yet (export reads the stored recommendation, never Optuna).",
)
@click.option(
    "--cluster",
    "cluster_file",
    metavar="FILE",
    type=click.Path(dir_okay=False),
    help="prometheus-rules, prometheusrule, grafana, servicemonitor: the cluster file (its thresholds).",
)
@click.option(
    "--cluster-name", metavar="NAME", help="Which cluster of the file (needed when it has several)."
)
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
@click.option(
    "--out",
    type=click.Path(dir_okay=False, writable=True),
    metavar="FILE",
    help="Write here (atomically) instead of standard output.",
)
@click.option(
    "--model", default="MODEL", show_default=True, help="vllm-args, helm: the model vLLM serves."
)
@click.option(
    "--scheduler",
    type=click.Choice(["async", "sync"]),
    default="async",
    show_default=True,
    help="Plugin class: async = TailpilotAsyncScheduler (vLLM's GPU default), sync = TailpilotScheduler "
    "(async scheduling off, CPU).",
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
    "--replicas", type=click.IntRange(1), default=1, show_default=True, help="helm: replicaCount."
)
@click.option("--engine-name", default="llm", show_default=True, help="helm: modelSpec name.")
@click.option(
    "--api-port",
    type=click.IntRange(1, 65535),
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
    metavar="KEY=VALUE",
    help="prometheusrule, servicemonitor: an extra metadata label, e.g. release=kube-prometheus-stack "
    "(repeatable).",
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
    help="prometheus-rules: how long a governance figure stays below its threshold before its alert "
    "fires (default: the cluster file's alerts.for_s, as the recorder's own alerts).",
)
def export(
    settings_file,
    study,
    db,
    storage,
    cluster_file,
    cluster_name,
    fmt,
    out,
    model,
    scheduler,
    settings_path,
    name,
    namespace,
    image,
    replicas,
    engine_name,
    api_port,
    token_secret,
    service_monitor,
    labels,
    interval,
    for_,
):
    """Write settings for deployment — the plugin's settings JSON, a `vllm serve` command line,
    a Kubernetes ConfigMap or Helm values for the vLLM production-stack chart — or a cluster's
    monitoring: Prometheus alert rules at its thresholds, a Grafana dashboard, a ServiceMonitor for
    the recorder. Every output is parsed back and checked before it is written."""
    from controlplane.monitoring import FORMATS as MONITORING_FORMATS

    if fmt in MONITORING_FORMATS:
        return _export_monitoring(
            cluster_file,
            cluster_name,
            fmt,
            out,
            namespace,
            interval,
            for_,
            labels,
            conflicting=settings_file or study,
        )
    if cluster_file:
        raise click.UsageError(
            f"--cluster goes with --format {', '.join(MONITORING_FORMATS)}; "
            f"{fmt} exports settings (--settings or --study)"
        )
    from controlplane.export import (
        ExportError,
        ExportOptions,
        load_settings_file,
        render,
        settings_from_study,
    )

    if bool(settings_file) == bool(study):
        raise click.UsageError("give exactly one of --settings FILE and --study NAME")
    source = None
    try:
        if settings_file:
            settings = load_settings_file(settings_file)
            source = f"file {Path(settings_file).name}"
        else:
            store = open_store(db, must_exist=True)
            try:
                settings, rec = settings_from_study(store, study, storage=storage, db=db)
            finally:
                store.close()
            source = f"study {study}, recommendation #{rec.id}"
    except ExportError as err:
        raise click.UsageError(str(err)) from None
    except (
        RecursionError
    ):  # JSON nested past Python's recursion limit (controlplane.export lets it through)
        raise click.UsageError(f"{settings_file or study}: not JSON: nested too deeply") from None
    if fmt == "helm":
        _check_interval(interval)
    options = ExportOptions(
        model=model,
        scheduler=scheduler,
        settings_path=settings_path,
        name=name,
        namespace=namespace,
        source=source,
        engine_name=engine_name,
        image=image,
        replicas=replicas,
        api_port=api_port,
        token_secret=token_secret,
        service_monitor=service_monitor,
        scrape_interval=interval,
    )
    try:
        text = render(settings, fmt, options)
    except ExportError as err:
        raise click.ClickException(str(err)) from None
    _write(text, out, f"{fmt} for {settings.policy} ({source})")
    if fmt == "vllm-args":
        click.echo(
            f"(write the settings file it names with: tailpilot export ... --format settings "
            f"--out {settings_path})",
            err=True,
        )


def _checked(check, value, hint: str):
    """``check(value)``, its MonitoringExportError ("field: problem") as a usage error on ``hint``."""
    from controlplane.monitoring import MonitoringExportError

    try:
        return check(value)
    except MonitoringExportError as err:
        raise click.BadParameter(str(err).split(": ", 1)[1], param_hint=hint) from None


def _check_interval(interval: str) -> None:
    from controlplane.monitoring import check_duration

    _checked(lambda v: check_duration(v, "interval"), interval, "--interval")


def _write(text: str, out: str | None, what: str) -> None:
    from controlplane.export import write_atomically

    if out:
        try:
            write_atomically(out, text)
        except OSError as err:
            raise click.ClickException(f"cannot write {out}: {err.strerror or err}") from None
        click.echo(f"wrote {what} to {out}", err=True)
    else:
        click.echo(text, nl=False)


def _export_monitoring(
    cluster_file, cluster_name, fmt, out, namespace, interval, for_, labels, conflicting
) -> None:
    from controlplane.monitoring import MonitoringExportError, check_duration, check_labels, render
    from tailpilot.cli_cluster import load_cluster

    if conflicting:
        raise click.UsageError(
            f"--format {fmt} exports a cluster's monitoring: give --cluster FILE, "
            "not --settings or --study"
        )
    if not cluster_file:
        raise click.UsageError(
            f"--format {fmt} needs --cluster FILE (the cluster file with its thresholds)"
        )
    cluster = load_cluster(cluster_file, cluster_name)
    if for_ is not None:
        _checked(lambda v: check_duration(v, "for"), for_, "--for")
    _check_interval(interval)
    extra = {}
    for item in labels:
        key, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE", param_hint="--label")
        extra[key] = value
    _checked(check_labels, extra, "--label")
    try:
        text = render(cluster, fmt, namespace=namespace, for_=for_, interval=interval, labels=extra)
    except MonitoringExportError as err:
        raise click.ClickException(str(err)) from None
    governed = "governed" if cluster.governance is not None else "not governed: replica alerts only"
    _write(text, out, f"{fmt} for cluster {cluster.name} ({governed})")


# --------------------------------------------------------------------------------------------
@click.command()
@click.option(
    "--db",
    metavar="URL",
    help=f"Store that knows the replica (default ${DB_ENV} or ./tailpilot.db).",
)
@click.option(
    "--replica", metavar="NAME", help="The replica to calibrate on, as named in the store."
)
@click.option(
    "--cluster-name", metavar="NAME", help="Its cluster (needed when the name is in several)."
)
@click.option(
    "--url",
    metavar="URL",
    help="Calibrate straight from this control API instead (http://host:port).",
)
@click.option(
    "--name",
    "set_name",
    metavar="SETNAME",
    help="Name of the coefficient set to save (default calibrated/<replica>).",
)
@click.option(
    "--min-steps",
    type=click.IntRange(5),
    default=50,
    show_default=True,
    help="Refuse to fit fewer usable steps than this.",
)
@click.option(
    "--holdout",
    type=FiniteFloatRange(0, 0.5),
    default=0.2,
    show_default=True,
    help="Fraction of steps held out to measure the error on unseen steps.",
)
@click.option(
    "--base",
    metavar="SETNAME",
    help="Keep this set's values for terms the log cannot determine (default: refuse such a log).",
)
@click.option(
    "--timeout", type=POSITIVE, default=10.0, show_default=True, help="Seconds per HTTP request."
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
    help="The loss: absolute error keeps long steps' share of the total (what queues feel); relative "
    "weighs every step alike. Either way the fit is scaled to the recorded total.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def calibrate(
    db,
    replica,
    cluster_name,
    url,
    set_name,
    min_steps,
    holdout,
    base,
    timeout,
    save,
    overwrite,
    error,
    as_json,
):
    """Fit the step-time model's coefficients to a live replica's step log, report the fit error
    (also on held-out steps) and save them as a named coefficient set for the simulator and the
    tuner (--step-model NAME)."""
    from sim.stepmodel import COEFFICIENT_SETS, get_model, save_user_model
    from tuner.calibrate import (
        CalibrationError,
        ReplicaUnreachable,
        calibrate_steps,
        fetch_engine_facts,
        fetch_step_log,
        format_report,
        replica_control_url,
    )

    if url and (replica or db or cluster_name):
        raise click.UsageError("give either --url or --replica (with --db), not both")
    if not url and not replica:
        raise click.UsageError("give --replica NAME (looked up in the store) or --url URL")
    base_model = None
    if base:
        try:
            base_model = get_model(base)
        except ValueError as err:
            raise click.BadParameter(str(err), param_hint="--base") from None
    if set_name is not None and not set_name.strip():
        raise click.BadParameter("must not be empty", param_hint="--name")
    if set_name in COEFFICIENT_SETS:
        raise click.BadParameter(
            f"{set_name!r} is a built-in coefficient set; choose another name", param_hint="--name"
        )
    if not url:
        store = open_store(db, must_exist=True)
        try:
            cluster, control_url = replica_control_url(store, replica, cluster_name)
        except CalibrationError as err:
            raise click.BadParameter(str(err), param_hint="--replica") from None
        finally:
            store.close()
        where = f"replica {replica} of cluster {cluster} ({control_url})"
    else:
        control_url, where = url, url
    try:
        reported_name, steps = fetch_step_log(control_url, timeout=timeout)
    except ReplicaUnreachable as err:
        raise click.ClickException(f"{replica or url} is unreachable: {err}") from None
    name = set_name or f"calibrated/{replica or reported_name or 'replica'}"
    if name in COEFFICIENT_SETS:
        raise click.BadParameter(
            f"{name!r} is a built-in coefficient set; choose another name", param_hint="--name"
        )
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


COMMANDS = (export, calibrate)
