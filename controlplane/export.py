"""Export a settings document for deployment (docs/engine.md#tuner, "Export"; ``tailpilot export``).

Four formats, each rendered from one validated :class:`~scheduler.settings.Settings`:

``settings``   the JSON document the plugin reads at start-up from ``$TAILPILOT_SETTINGS_FILE``;
``vllm-args``  one shell-quoted ``vllm serve MODEL ...`` line: the env assignment naming the
               settings file, ``--scheduler-cls`` and the engine flags that must agree with the
               document's ``engine`` block (vLLM cannot change them live);
``configmap``  a Kubernetes ConfigMap (``apiVersion: v1``) holding ``settings.json``;
``helm``       values for the vLLM production-stack chart (``vllm-stack``): the scheduler class
               and engine flags through the chart's own keys, the ConfigMap mounted as a volume,
               ``TAILPILOT_SETTINGS_FILE`` pointing into it.

Every rendering is parsed back (JSON, ``shlex.split``, ``strict_yaml.load``) and checked against
its input before it is returned — the settings inside equal the input and the flags match — so a
written file is known to round-trip. :func:`parse_vllm_args`, :func:`settings_from_configmap` and
:func:`settings_from_helm_values` are those parsers, public for tests and tooling.

Only settings a live replica accepts are exported: a document with the ``oracle`` length predictor
(true lengths exist only in the simulator) is refused, as the plugin would refuse it at start-up.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError

from controlplane import strict_yaml
from controlplane.monitoring.prometheus import scrape_timeout
from scheduler.errors import TailpilotError
from scheduler.plugin.wire import parse_json_file
from scheduler.settings import Settings, describe_error
from scheduler.settings_change import split_assignment

if TYPE_CHECKING:  # annotations only: the store is the caller's (sqlalchemy is not loaded here)
    from storage.store import Store
    from storage.tuner_results import RecommendationInfo

FORMATS = ("settings", "vllm-args", "configmap", "helm")
SETTINGS_FILE_ENV = "TAILPILOT_SETTINGS_FILE"  # = scheduler.plugin.core.SETTINGS_FILE_ENV
SCHEDULER_CLASSES = {
    # vLLM's GPU default (0.33) is async scheduling; the stock scheduler when it is off (and on
    # CPU).
    "async": "scheduler.plugin.vllm.TailpilotAsyncScheduler",
    "sync": "scheduler.plugin.vllm.TailpilotScheduler",
}
MODEL_PLACEHOLDER = "MODEL"
DEFAULT_SETTINGS_PATH = "tailpilot-settings.json"  # vllm-args: next to where vLLM is started
CONFIGMAP_KEY = "settings.json"
DEFAULT_CONFIGMAP_NAME = "tailpilot-settings"
MOUNT_DIR = "/etc/tailpilot"  # helm: where the ConfigMap is mounted in the vLLM container
SETTINGS_ANNOTATION = (
    "tailpilot/settings"  # helm: pod annotation; a changed document rolls the pods
)
HASH_ANNOTATION = "tailpilot/settings-sha256"
DEFAULT_API_PORT = 8765

# The chart and the schema the helm values follow.
HELM_CHART = "vllm-stack"
HELM_SCHEMA_NOTE = (
    "chart vllm-stack 0.1.x of vllm-project/production-stack (main branch; newest Chart.yaml seen: "
    "0.1.16), its helm/values.schema.json and templates/deployment-vllm-multi.yaml. Keys used: "
    "servingEngineSpec.modelSpec[] name, repository, tag, modelURL, replicaCount, requestCPU, "
    "requestMemory, requestGPU, pvcStorage (all required by the schema), podAnnotations, "
    "vllmConfig.enablePrefixCaching, vllmConfig.maxNumSeqs (-> --max-num-seqs), "
    "vllmConfig.extraArgs (each entry one argument), env (name/value pairs), envFromSecret, "
    "extraVolumes, extraVolumeMounts"
)


class ExportError(TailpilotError, ValueError):
    """Settings that cannot be exported, or a rendering that did not parse back to its input."""


class NoRecommendation(ExportError):
    """No recommendation is stored for the study (``tailpilot recommend`` has not run on it)."""


# Kubernetes' object names (RFC 1123) and image references, and its limit on a ConfigMap.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"(?=.{1,253}$)[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_IMAGE = re.compile(
    r"([A-Za-z0-9.-]+(:[0-9]+)?/)?[a-z0-9]+([._-]+[a-z0-9]+)*(/[a-z0-9]+([._-]+[a-z0-9]+)*)*"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[a-f0-9]{64})?"
)
CONFIGMAP_MAX_BYTES = 1024 * 1024  # the API server refuses a larger ConfigMap


@dataclass(frozen=True)
class ExportOptions:
    """What the formats need besides the settings (each format reads the fields it uses)."""

    model: str = MODEL_PLACEHOLDER  # vllm-args, helm: the model vLLM serves
    scheduler: str = "async"  # "async" | "sync" (see SCHEDULER_CLASSES)
    settings_path: str = DEFAULT_SETTINGS_PATH  # vllm-args: the settings file on the host
    name: str = DEFAULT_CONFIGMAP_NAME  # configmap / helm: the ConfigMap's name
    namespace: str | None = None  # configmap: metadata.namespace
    source: str | None = None  # configmap / helm: where the settings came from (an annotation)
    # helm only
    engine_name: str = "llm"  # modelSpec[].name (the chart names the deployment after it)
    image: str = "vllm/vllm-openai:latest"  # must contain tailpilot (pip install tailpilot)
    replicas: int = 1
    request_cpu: int = 8
    request_memory: str = "32Gi"
    request_gpu: int = 1
    pvc_storage: str = "50Gi"
    api_port: int = DEFAULT_API_PORT
    token_secret: str | None = None  # a Secret whose keys (TAILPILOT_TOKEN) become env vars
    # The chart's ServiceMonitor for the engines' /metrics: off unless asked (the chart creates it
    # unconditionally, and a cluster without the Prometheus Operator's CRDs refuses the install).
    service_monitor: bool = False
    scrape_interval: str = "15s"

    def __post_init__(self) -> None:
        # What Kubernetes accepts, checked before anything is written (it refuses the apply
        # otherwise, after the file went out): the --option named in each error.
        for option, value, rule in (
            ("--name", self.name, _DNS_SUBDOMAIN),
            ("--namespace", self.namespace, _DNS_LABEL),
            ("--engine-name", self.engine_name, _DNS_LABEL),
            ("--token-secret", self.token_secret, _DNS_SUBDOMAIN),
        ):
            if value is not None and not rule.fullmatch(value):
                limit = 253 if rule is _DNS_SUBDOMAIN else 63
                raise ExportError(
                    f"{option} {value[:80]!r}: not a Kubernetes name (at most {limit} lowercase "
                    "letters, digits and '-'"
                    + (" or '.'" if rule is _DNS_SUBDOMAIN else "")
                    + ", starting and ending with a letter or digit)"
                )
        if not _IMAGE.fullmatch(self.image) or len(self.image) > 255:
            raise ExportError(
                f"--image {self.image[:80]!r}: not an image reference "
                "([registry/]repository[:tag][@sha256:digest], lowercase repository)"
            )

    @property
    def scheduler_cls(self) -> str:
        try:
            return SCHEDULER_CLASSES[self.scheduler]
        except KeyError:
            raise ExportError(
                f"scheduler: expected one of {', '.join(SCHEDULER_CLASSES)}, got {self.scheduler!r}"
            ) from None

    @property
    def image_repository_tag(self) -> tuple[str, str]:
        image = self.image
        slash = image.rfind("/")
        colon = image.rfind(":")
        if colon > slash:
            return image[:colon], image[colon + 1 :]
        return image, "latest"


# ---------------------------------------------------------------------------------------------
# input
# ---------------------------------------------------------------------------------------------


def check_exportable(settings: Settings, where: str | None = None) -> Settings:
    """Refuse what a live replica refuses at start-up (the plugin builds its policy from the
    document; the simulator-only ``oracle`` predictor fails there)."""
    # Imported here for start-up cost: the plugin core loads the policy library and scipy (~350 ms
    # measured on top of this module), which only this check needs.
    from scheduler.plugin.core import ReplicaCore

    try:
        ReplicaCore(settings)
    except (ValidationError, ValueError) as err:
        prefix = f"{where}: " if where else ""
        raise ExportError(
            f"{prefix}a live replica would refuse these settings: {describe_error(err)}"
        ) from None
    return settings


def validate_document(doc: Any, where: str) -> Settings:
    """A settings document (dict) → Settings; errors name ``where`` and the field."""
    if not isinstance(doc, dict):
        raise ExportError(f"{where}: expected a settings object, got {type(doc).__name__}")
    try:
        settings = Settings.model_validate(doc)
    except (ValidationError, ValueError) as err:
        raise ExportError(f"{where}: {describe_error(err)}") from None
    return check_exportable(settings, where)


def load_settings_file(path: str | Path) -> Settings:
    """Read and validate a settings JSON file (the same document the plugin reads)."""
    path = Path(path)
    try:
        doc = parse_json_file(path)
    except OSError as err:
        raise ExportError(f"{path}: cannot read: {err.strerror or err}") from None
    except ValueError as err:  # not UTF-8, not JSON, a key twice, NaN, ... (strict, as the plugin)
        raise ExportError(f"{path}: {err}") from None
    return validate_document(doc, str(path))


def settings_from_study(
    store: Store, study: str, *, storage: str | None = None, db: str | None = None
) -> tuple[Settings, RecommendationInfo]:
    """The settings of the newest recommendation stored for ``study`` (``tailpilot recommend``), and
    that recommendation (a ``storage.tuner_results.RecommendationInfo``). ``storage`` and ``db``
    only complete the command suggested when there is none."""
    rec = store.tuner.latest_recommendation(study)
    if rec is None:
        hint = f"tailpilot recommend --study {study}"
        if storage:
            hint += f" --storage {storage}"
        if db:
            hint += f" --db {db}"
        raise NoRecommendation(f"no recommendation stored for study {study!r}; run `{hint}` first")
    doc = rec.settings
    if isinstance(doc, dict) and isinstance(doc.get("settings"), dict) and "policy" not in doc:
        doc = doc["settings"]  # tolerate a wrapped document ({"settings": {...}, ...})
    return validate_document(doc, f"recommendation #{rec.id} of study {study!r}"), rec


# ---------------------------------------------------------------------------------------------
# renderings
# ---------------------------------------------------------------------------------------------


def settings_json(settings: Settings) -> str:
    """The start-up document, exactly as ``$TAILPILOT_SETTINGS_FILE`` expects it."""
    return json.dumps(settings.to_dict(), indent=2, sort_keys=False) + "\n"


def _compact_json(settings: Settings) -> str:
    return json.dumps(settings.to_dict(), separators=(",", ":"), sort_keys=True)


def settings_sha256(settings: Settings) -> str:
    return hashlib.sha256(_compact_json(settings).encode()).hexdigest()


def engine_flags(settings: Settings) -> list[str]:
    """vLLM flags for the document's engine block (``--long-prefill-token-threshold`` only when
    on)."""
    eng = settings.engine
    flags = [
        "--max-num-seqs",
        str(eng.max_num_seqs),
        "--max-num-batched-tokens",
        str(eng.max_num_batched_tokens),
    ]
    if eng.long_prefill_token_threshold > 0:
        flags += ["--long-prefill-token-threshold", str(eng.long_prefill_token_threshold)]
    return flags


def plugin_flags(settings: Settings, options: ExportOptions) -> list[str]:
    return ["--scheduler-cls", options.scheduler_cls, *engine_flags(settings)]


def vllm_args(settings: Settings, options: ExportOptions = ExportOptions()) -> str:
    argv = [
        f"{SETTINGS_FILE_ENV}={options.settings_path}",
        "vllm",
        "serve",
        options.model,
        *plugin_flags(settings, options),
    ]
    return " ".join(shlex.quote(a) for a in argv) + "\n"


def configmap_doc(settings: Settings, options: ExportOptions = ExportOptions()) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": options.name}
    if options.namespace:
        metadata["namespace"] = options.namespace
    metadata["labels"] = {
        "app.kubernetes.io/name": "tailpilot",
        "app.kubernetes.io/component": "settings",
    }
    annotations = {HASH_ANNOTATION: settings_sha256(settings)}
    if options.source:
        annotations["tailpilot/source"] = options.source
    metadata["annotations"] = annotations
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata,
        "data": {CONFIGMAP_KEY: settings_json(settings)},
    }


def configmap(settings: Settings, options: ExportOptions = ExportOptions()) -> str:
    header = [
        f"tailpilot settings ({settings.policy}) for the scheduler plugin; mount it and set",
        f"{SETTINGS_FILE_ENV} to <mount dir>/{CONFIGMAP_KEY} in the vLLM container.",
    ]
    return strict_yaml.dump(configmap_doc(settings, options), header)


def helm_values_doc(settings: Settings, options: ExportOptions = ExportOptions()) -> dict[str, Any]:
    repository, tag = options.image_repository_tag
    eng = settings.engine
    extra_args = [
        "--scheduler-cls",
        options.scheduler_cls,
        "--max-num-batched-tokens",
        str(eng.max_num_batched_tokens),
    ]
    if eng.long_prefill_token_threshold > 0:
        extra_args += ["--long-prefill-token-threshold", str(eng.long_prefill_token_threshold)]
    env = [
        {"name": SETTINGS_FILE_ENV, "value": f"{MOUNT_DIR}/{CONFIGMAP_KEY}"},
        {"name": "TAILPILOT_API_HOST", "value": "0.0.0.0"},
        {"name": "TAILPILOT_API_PORT", "value": str(options.api_port)},
    ]
    annotations = {
        SETTINGS_ANNOTATION: _compact_json(settings),
        HASH_ANNOTATION: settings_sha256(settings),
    }
    spec: dict[str, Any] = {
        "name": options.engine_name,
        "repository": repository,
        "tag": tag,
        "modelURL": options.model,
        "replicaCount": options.replicas,
        "requestCPU": options.request_cpu,
        "requestMemory": options.request_memory,
        "requestGPU": options.request_gpu,
        "pvcStorage": options.pvc_storage,
        "podAnnotations": annotations,
        "vllmConfig": {
            # The chart passes --no-enable-prefix-caching unless this is true: keep vLLM's default.
            "enablePrefixCaching": True,
            "maxNumSeqs": eng.max_num_seqs,
            "extraArgs": extra_args,
        },
        "env": env,
        "extraVolumes": [{"name": "tailpilot-settings", "configMap": {"name": options.name}}],
        "extraVolumeMounts": [
            {"name": "tailpilot-settings", "mountPath": MOUNT_DIR, "readOnly": True}
        ],
    }
    if options.token_secret:
        spec["envFromSecret"] = {"name": options.token_secret}
    engine: dict[str, Any] = {"modelSpec": [spec]}
    if options.service_monitor:
        # The chart's own ServiceMonitor: Prometheus scrapes each engine's vLLM /metrics
        # (tailpilot's figures come from the recorder's, `tailpilot export --cluster ... --format
        # servicemonitor`).
        engine["serviceMonitor"] = {
            "enabled": True,
            "interval": options.scrape_interval,
            "scrapeTimeout": scrape_timeout(options.scrape_interval),
            "honorLabels": False,
        }
    return {"servingEngineSpec": engine}


def helm_values(settings: Settings, options: ExportOptions = ExportOptions()) -> str:
    name = options.name
    header = [
        f"Helm values for the vLLM production-stack chart ({HELM_CHART}), written by "
        "`tailpilot export`.",
        f"Schema followed: {HELM_SCHEMA_NOTE}.",
        "",
        f"The scheduler plugin reads its settings from the ConfigMap {name!r}, mounted at "
        f"{MOUNT_DIR}; create it first (same settings):",
        "",
        f"    tailpilot export ... --format configmap --name {name} | kubectl apply -f -",
        "",
        f"The pod annotation {SETTINGS_ANNOTATION} carries the same document, so a new one rolls "
        "the pods.",
        "The image must have tailpilot installed next to vLLM (FROM vllm/vllm-openai; "
        "pip install tailpilot).",
        f"The control API listens on every pod at :{options.api_port} (TAILPILOT_API_HOST/PORT); "
        "writes need a token: pass --token-secret NAME for a Secret holding TAILPILOT_TOKEN"
        + (f" (this file uses {options.token_secret!r})." if options.token_secret else "."),
        "requestCPU/requestMemory/requestGPU/pvcStorage are required by the chart's schema: "
        "adjust them.",
    ]
    if options.service_monitor:
        header.append(
            "servingEngineSpec.serviceMonitor makes the chart create a ServiceMonitor for the "
            "engines' vLLM /metrics (Prometheus Operator); tailpilot's own tailpilot_* series come "
            "from the recorder: tailpilot export --cluster FILE --format servicemonitor."
        )
    return strict_yaml.dump(helm_values_doc(settings, options), header)


# settings_json takes no options (render() calls it on its own); the others take (settings,
# options).
RENDERERS: dict[str, Callable[..., str]] = {
    "settings": settings_json,
    "vllm-args": vllm_args,
    "configmap": configmap,
    "helm": helm_values,
}


# ---------------------------------------------------------------------------------------------
# parsing back
# ---------------------------------------------------------------------------------------------


def _flag_pairs(args: list[str], where: str) -> dict[str, str]:
    """``--name value`` / ``--name=value`` pairs → {"--name": "value"}; repeated flags are an
    error."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ExportError(f"{where}: expected a --flag, got {arg!r}")
        if (parts := split_assignment(arg)) is not None:
            name, value = parts
            i += 1
        else:
            if i + 1 >= len(args):
                raise ExportError(f"{where}: {arg} has no value")
            name, value = arg, args[i + 1]
            i += 2
        if name in out:
            raise ExportError(f"{where}: {name} given twice")
        out[name] = value
    return out


def parse_vllm_args(text: str) -> tuple[dict[str, str], str, dict[str, str]]:
    """A ``[NAME=VALUE ...] vllm serve MODEL --flag value ...`` line → (env, model, flags)."""
    argv = shlex.split(text, comments=True)
    env: dict[str, str] = {}
    while (
        argv
        and not argv[0].startswith("-")
        and (parts := split_assignment(argv[0])) is not None
        and parts[0].isidentifier()
    ):
        argv.pop(0)
        name, value = parts
        env[name] = value
    if argv[:2] != ["vllm", "serve"] or len(argv) < 3:
        raise ExportError(f"vllm-args: expected `vllm serve MODEL ...`, got {' '.join(argv[:3])!r}")
    return env, argv[2], _flag_pairs(argv[3:], "vllm-args")


def settings_from_configmap(text: str) -> Settings:
    doc = strict_yaml.load(text)
    if not isinstance(doc, dict) or doc.get("apiVersion") != "v1" or doc.get("kind") != "ConfigMap":
        raise ExportError("configmap: not a v1 ConfigMap")
    data = doc.get("data") or {}
    if not isinstance(data.get(CONFIGMAP_KEY), str):
        raise ExportError(f"configmap: data.{CONFIGMAP_KEY} is missing or not a string")
    return Settings.model_validate(json.loads(data[CONFIGMAP_KEY]))


def settings_from_helm_values(text: str) -> tuple[Settings, dict[str, Any]]:
    """(the settings in the pod annotation, the modelSpec entry) of helm values we wrote."""
    doc = strict_yaml.load(text)
    try:
        [spec] = doc["servingEngineSpec"]["modelSpec"]
        annotation = spec["podAnnotations"][SETTINGS_ANNOTATION]
    except (KeyError, TypeError, ValueError):
        raise ExportError(
            "helm: expected servingEngineSpec.modelSpec with one entry carrying "
            f"podAnnotations[{SETTINGS_ANNOTATION!r}]"
        ) from None
    return Settings.model_validate(json.loads(annotation)), spec


# ---------------------------------------------------------------------------------------------
# verification
# ---------------------------------------------------------------------------------------------


def _expect(cond: bool, fmt: str, what: str) -> None:
    if not cond:
        raise ExportError(
            f"{fmt}: the rendering did not parse back to its input ({what}); "
            "this is a bug in tailpilot export"
        )


def verify(
    fmt: str, text: str, settings: Settings, options: ExportOptions = ExportOptions()
) -> None:
    """Parse a rendering back and check it carries ``settings`` and ``options`` exactly."""
    try:
        _verify(fmt, text, settings, options)
    except ExportError:
        raise
    except (ValidationError, ValueError, KeyError, TypeError, yaml.YAMLError) as err:
        raise ExportError(f"{fmt}: the rendering does not parse back: {err}") from None


def _verify(fmt: str, text: str, settings: Settings, options: ExportOptions) -> None:
    want_flags = _flag_pairs(plugin_flags(settings, options), "expected")
    if fmt == "settings":
        back = Settings.model_validate(json.loads(text))
        _expect(back == settings and json.loads(text) == settings.to_dict(), fmt, "settings differ")
    elif fmt == "vllm-args":
        env, model, flags = parse_vllm_args(text)
        _expect(env == {SETTINGS_FILE_ENV: options.settings_path}, fmt, f"env {env}")
        _expect(model == options.model, fmt, f"model {model!r}")
        _expect(flags == want_flags, fmt, f"flags {flags} != {want_flags}")
    elif fmt == "configmap":
        doc = strict_yaml.load(text)
        _expect(doc["metadata"]["name"] == options.name, fmt, "metadata.name")
        _expect(
            doc["metadata"].get("namespace") == (options.namespace or None),
            fmt,
            "metadata.namespace",
        )
        _expect(settings_from_configmap(text) == settings, fmt, "settings differ")
        _expect(
            json.loads(doc["data"][CONFIGMAP_KEY]) == settings.to_dict(),
            fmt,
            "settings.json differs",
        )
    elif fmt == "helm":
        back, spec = settings_from_helm_values(text)
        _expect(back == settings, fmt, "settings in the pod annotation differ")
        vcfg = spec["vllmConfig"]
        _expect(vcfg["maxNumSeqs"] == settings.engine.max_num_seqs, fmt, "vllmConfig.maxNumSeqs")
        # What the chart's template puts on the command line: --max-num-seqs from maxNumSeqs,
        # then every extraArgs entry as its own argument.
        argv = ["--max-num-seqs", str(vcfg["maxNumSeqs"]), *[str(a) for a in vcfg["extraArgs"]]]
        _expect(_flag_pairs(argv, "helm") == want_flags, fmt, f"flags {argv}")
        _expect(spec["modelURL"] == options.model, fmt, "modelURL")
        env = {e["name"]: e["value"] for e in spec["env"]}
        for e in spec["env"]:
            _expect(
                set(e) == {"name", "value"} and isinstance(e["value"], str),
                fmt,
                "env entries are name/value strings",
            )
        path = env.get(SETTINGS_FILE_ENV, "")
        mounts = {m["name"]: m["mountPath"] for m in spec["extraVolumeMounts"]}
        volumes = {v["name"]: v for v in spec["extraVolumes"]}
        mounted = [n for n, d in mounts.items() if path == f"{d.rstrip('/')}/{CONFIGMAP_KEY}"]
        _expect(
            len(mounted) == 1
            and volumes.get(mounted[0], {}).get("configMap", {}).get("name") == options.name,
            fmt,
            f"{SETTINGS_FILE_ENV}={path!r} is not {CONFIGMAP_KEY} of the mounted ConfigMap "
            f"{options.name!r}",
        )
        for key in ("name", "repository", "tag", "modelURL", "requestMemory", "pvcStorage"):
            _expect(
                isinstance(spec.get(key), str) and spec[key],
                fmt,
                f"modelSpec.{key} must be a string",
            )
        for key in ("replicaCount", "requestCPU", "requestGPU"):
            _expect(isinstance(spec.get(key), int), fmt, f"modelSpec.{key} must be an integer")
        monitor = strict_yaml.load(text)["servingEngineSpec"].get("serviceMonitor")
        _expect(
            bool(monitor and monitor.get("enabled")) == options.service_monitor,
            fmt,
            "serviceMonitor.enabled",
        )
    else:
        raise ExportError(f"unknown format {fmt!r} (valid: {', '.join(FORMATS)})")


def render(settings: Settings, fmt: str, options: ExportOptions = ExportOptions()) -> str:
    """Render ``settings`` in ``fmt``, parse the result back and check it (ExportError if not)."""
    if fmt not in RENDERERS:
        raise ExportError(f"unknown format {fmt!r} (valid: {', '.join(FORMATS)})")
    options.scheduler_cls  # noqa: B018 (validates the choice)
    check_exportable(settings)
    text = RENDERERS[fmt](settings, options) if fmt != "settings" else settings_json(settings)
    if fmt == "configmap" and len(text.encode()) > CONFIGMAP_MAX_BYTES:
        raise ExportError(
            f"the ConfigMap is {len(text.encode())} bytes, over Kubernetes' limit of "
            f"{CONFIGMAP_MAX_BYTES}"
        )
    verify(fmt, text, settings, options)
    return text


def write_atomically(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` via a temporary file renamed over it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
