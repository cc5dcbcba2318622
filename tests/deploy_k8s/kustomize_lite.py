"""A small kustomize: ``render`` builds a kustomization for the subset the manifests use.

Resources, namespace, labels, configMapGenerator, images, patches as strategic merges keyed by
kind + name, generated names with a content-hash suffix and the references to them. Any
kustomization key or option it does not implement, a file outside the kustomization's folder
(kustomize's load restrictor) or a patch that matches nothing raises ``KustomizeError``.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml


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
