"""The roles as the base and the overlays of deploy/k8s/ deploy them: workers advertise their
pod IP and probe the registry, the gateway probes its HTTP endpoints, every role has a
disruption budget, cpu-demo builds the tiny model in every pod, gpu gives each worker a GPU and
the CUDA image."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.kustomize import render, split_image
from tests.deploy.layout import BASE, OVERLAYS, PROBE_SCRIPT, ROLES, VENV_PYTHON, WORKERS
from tests.deploy.manifests import (
    deployment,
    env_of,
    generated_data,
    main_container,
    named,
    of_kind,
    selects,
)


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
