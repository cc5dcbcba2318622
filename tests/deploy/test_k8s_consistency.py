"""The rendered objects of deploy/k8s/ agree with each other and with the code: probes,
requests and pinned images on every workload, selectors that match pods and ports, references
that resolve (and the checks catch each kind of breakage), every KVPUSH_* variable is one the
code reads, the NATS URL is the Helm chart's Service, the collector's configuration is
deploy/observability's file, the kvpush images carry the project version."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final

import pytest
import yaml

from tests.deploy.checks import check_references, check_selectors, check_workloads
from tests.deploy.kustomize import all_containers, render, split_image
from tests.deploy.layout import (
    BASE,
    COLLECTOR_CONFIG,
    COMPOSE,
    KVPUSH_IMAGES,
    NAMESPACE,
    OPERATING_DOC,
    OVERLAYS,
)
from tests.deploy.manifests import (
    RENDERED,
    code_text,
    config_maps,
    deployment,
    generated_data,
    helm_values,
    kvpush_variables,
    main_container,
    named,
    project_version,
    workloads,
)


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


def read_variables() -> set[str]:
    """Every KVPUSH_* variable a service reads: its settings tables, and names in the code."""
    from kvpush.services.gateway.config import SETTINGS as GATEWAY
    from kvpush.services.up_config import SETTINGS as UP
    from kvpush.services.workers.flags import SETTINGS as WORKER

    named = set(re.findall(r'"(KVPUSH_[A-Z0-9_]+)"', code_text()))
    return named | {row.variable for table in (GATEWAY, WORKER, UP) for row in table}


def test_every_kvpush_variable_in_the_manifests_is_read_by_the_code() -> None:
    read = read_variables()
    for path in RENDERED.values():
        unread = kvpush_variables(render(path)) - read
        assert not unread, f"{path}: the code reads none of {sorted(unread)}"


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


def test_kvpush_images_carry_the_project_version() -> None:
    for path in RENDERED.values():
        for obj in workloads(render(path)):
            for container in all_containers(obj["spec"]["template"]["spec"]):
                name, tag, _ = split_image(container["image"])
                if name in KVPUSH_IMAGES:
                    assert tag == project_version(), (path, container["image"])
