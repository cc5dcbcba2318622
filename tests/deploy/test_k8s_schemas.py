"""Every rendered object of deploy/k8s/ satisfies the Kubernetes schemas of the oldest and the
newest version we claim (ServiceMonitors: the subset of their CRD's schema), and the validator
really refuses unknown fields and wrong types."""

from __future__ import annotations

import copy
from typing import Any

from tests.deploy.kustomize import render
from tests.deploy.layout import MONITORING, OVERLAYS
from tests.deploy.manifests import deployment, named
from tests.deploy.schemas import schema_errors


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
