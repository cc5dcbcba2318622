"""Schema validation of rendered objects: the Kubernetes OpenAPI schemas that
kubernetes-validate ships (offline, strict: unknown fields fail) for the oldest and the newest
Kubernetes version we claim; ServiceMonitors and PodMonitors (CRDs) against the subset of their
schemas below."""

from __future__ import annotations

import copy
from typing import Any, Final

import jsonschema
import kubernetes_validate

from tests.deploy.layout import K8S_VERSIONS

# The part of the Prometheus Operator's ServiceMonitor and PodMonitor CRDs
# (monitoring.coreos.com/v1) the manifests use; unknown fields fail, as in the strict Kubernetes
# schemas. The two differ in their kind and the name of the endpoint list.
SERVICE_MONITOR_SCHEMA: Final[dict[str, Any]] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
            "additionalProperties": False,
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {
                            "type": "object",
                            "additionalProperties": {"type": "string"},
                        }
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": r"^\d+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string"},
                        },
                    },
                },
            },
        },
    },
}


def _pod_monitor_schema() -> dict[str, Any]:
    schema = copy.deepcopy(SERVICE_MONITOR_SCHEMA)
    schema["properties"]["kind"] = {"const": "PodMonitor"}
    spec = schema["properties"]["spec"]
    spec["required"] = ["selector", "podMetricsEndpoints"]
    spec["properties"]["podMetricsEndpoints"] = spec["properties"].pop("endpoints")
    return schema


MONITOR_SCHEMAS: Final = {
    "ServiceMonitor": SERVICE_MONITOR_SCHEMA,
    "PodMonitor": _pod_monitor_schema(),
}


def schema_errors(obj: dict[str, Any]) -> list[str]:
    where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    if obj.get("kind") in MONITOR_SCHEMAS:
        validator = jsonschema.Draft202012Validator(MONITOR_SCHEMAS[obj["kind"]])
        return [f"{where}: {e.json_path}: {e.message}" for e in validator.iter_errors(obj)]
    errors = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(map(str, exc.path))
            errors.append(f"{where} (Kubernetes {version}): {path}: {exc.message}")
    return errors
