"""The cross-object checks of rendered manifests: each returns its problems, as strings.

Probes and resources on every workload, PDB, Service and ServiceMonitor selectors that match
pods and ports, ConfigMap, Secret, PVC and volume references, ``$(VAR)`` references.
"""

from __future__ import annotations

import re
from typing import Any, Final

from tests.deploy.kustomize import (
    all_containers,
    config_map_refs,
    made_name,
    split_image,
)
from tests.deploy.manifests import config_maps, of_kind, selects, workloads


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
    port; ServiceMonitors select a Service that has the endpoint's port, PodMonitors pods that
    have it."""
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
    for monitor in of_kind(objects, "PodMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        matched = [t for t in pods.values() if selects(selector, t["metadata"]["labels"])]
        if not matched:
            problems.append(f"PodMonitor {made_name(monitor)} selects no pods")
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            for template in matched:
                names = {
                    p.get("name")
                    for c in template["spec"]["containers"]
                    for p in c.get("ports", [])
                }
                if endpoint["port"] not in names:
                    problems.append(
                        f"PodMonitor {made_name(monitor)}: no pod port {endpoint['port']}"
                    )
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
