"""Rendered objects: which kustomizations the tests render, lookups over their objects, and the
files the objects must agree with (Helm values, pyproject.toml's version, the code)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, Final

import yaml

from tests.deploy.kustomize import all_containers, made_name, render
from tests.deploy.layout import BASE, CODE_DIRS, HELM_VALUES, MONITORING, OVERLAYS, ROOT

RENDERED: Final = {"base": BASE, **OVERLAYS, "monitoring": MONITORING}
APPLIED_WITH: Final = {"monitoring": BASE}  # its ServiceMonitors select the base's Services


def render_applied(name: str) -> list[dict[str, Any]]:
    """The objects of ``RENDERED[name]``, with what it is applied next to."""
    beside = render(APPLIED_WITH[name]) if name in APPLIED_WITH else []
    return render(RENDERED[name]) + beside


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in of_kind(objects, kind) if made_name(o) == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
    return found[0]


def config_maps(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {made_name(o): o.get("data", {}) for o in of_kind(objects, "ConfigMap")}


def generated_data(objects: list[dict[str, Any]], prefix: str) -> dict[str, str]:
    """The data of the generated ConfigMap ``prefix-<hash>``."""
    found = [d for n, d in config_maps(objects).items() if re.fullmatch(rf"{prefix}-\w{{10}}", n)]
    assert len(found) == 1, f"ConfigMap {prefix}-<hash>: {len(found)} found"
    return found[0]


def deployment(objects: list[dict[str, Any]], role: str) -> dict[str, Any]:
    return named(objects, "Deployment", f"kvpush-{role}")


def main_container(deploy: dict[str, Any]) -> dict[str, Any]:
    return deploy["spec"]["template"]["spec"]["containers"][0]


def env_of(container: dict[str, Any], objects: list[dict[str, Any]]) -> dict[str, str]:
    """The container's environment as plain values: envFrom ConfigMaps, then env (fieldRef and
    secretKeyRef entries as placeholders)."""
    maps = config_maps(objects)
    values: dict[str, str] = {}
    for source in container.get("envFrom", []):
        values.update(maps.get(source.get("configMapRef", {}).get("name", ""), {}))
    for env in container.get("env", []):
        values[env["name"]] = env.get("value", f"<{next(iter(env.get('valueFrom', {})), '')}>")
    return values


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def workloads(objects: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    return (o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet"))


def code_text() -> str:
    return "\n".join(
        p.read_text(encoding="utf-8") for d in CODE_DIRS for p in sorted(d.rglob("*.py"))
    )


def kvpush_variables(objects: list[dict[str, Any]]) -> set[str]:
    names = {key for data in config_maps(objects).values() for key in data}
    for obj in workloads(objects):
        for container in all_containers(obj["spec"]["template"]["spec"]):
            names |= {env["name"] for env in container.get("env", [])}
    return {n for n in names if n.startswith("KVPUSH_")}


def helm_values() -> dict[str, Any]:
    return yaml.safe_load(HELM_VALUES.read_text(encoding="utf-8"))


def project_version() -> str:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r'^version = "([^"]+)"$', text, re.MULTILINE)
    assert match, "pyproject.toml: no version"
    return match[1]
