"""The manifests as ``kubectl kustomize`` renders them (kustomize built into kubectl, on every
machine image), and lookups over the rendered objects' pods.

``render`` runs the real renderer, so a manifest that kustomize would refuse fails here with
kustomize's own message; the object lists it returns are fresh each call (tests may change
them).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml


class KustomizeError(Exception):
    """kubectl kustomize refused the kustomization (its message), or kubectl is missing."""


def render(root: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize root``: the objects, in kustomize's order."""
    return [doc for doc in yaml.safe_load_all(_rendered(str(Path(root).resolve()))) if doc]


@functools.cache
def _kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        raise KustomizeError("kubectl is not on PATH (kustomize is built into it)")
    return found


def _rendered(root: str) -> str:
    done = subprocess.run(
        [_kubectl(), "kustomize", root], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise KustomizeError(f"kubectl kustomize {root}: {done.stderr.strip()[-1500:]}")
    return done.stdout


def made_name(obj: dict[str, Any]) -> str:
    return obj["metadata"]["name"]


def pod_specs(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    template = obj.get("spec", {}).get("template")
    if isinstance(template, dict) and "spec" in template:
        yield template["spec"]


def all_containers(pod: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from pod.get("initContainers", [])
    yield from pod.get("containers", [])


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """(name, tag, digest) of an image reference."""
    name, _, digest = image.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    return name, tag, digest or None


def config_map_refs(pod: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every dict of ``pod`` whose "name" names a ConfigMap."""
    for volume in pod.get("volumes", []):
        if "configMap" in volume:
            yield volume["configMap"]
        for source in volume.get("projected", {}).get("sources", []):
            if "configMap" in source:
                yield source["configMap"]
    for container in all_containers(pod):
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                yield source["configMapRef"]
        for env in container.get("env", []):
            if "configMapKeyRef" in env.get("valueFrom", {}):
                yield env["valueFrom"]["configMapKeyRef"]
