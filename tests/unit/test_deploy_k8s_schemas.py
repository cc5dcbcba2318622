"""Every rendered object of deploy/k8s/ satisfies the Kubernetes schemas of the oldest and the
newest version we claim (ServiceMonitors: the subset of their CRD's schema), and the validator
really refuses unknown fields and wrong types."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.deploy_k8s.kustomize import render
from tests.deploy_k8s.layout import MONITORING, OVERLAYS
from tests.deploy_k8s.manifests import RENDERED, deployment, named, render_applied
from tests.deploy_k8s.schemas import schema_errors


@pytest.fixture(scope="module", params=sorted(RENDERED))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    """(name, objects) of one kustomization, with what it is applied next to."""
    return request.param, render_applied(request.param)


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
