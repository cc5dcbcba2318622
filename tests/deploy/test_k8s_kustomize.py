"""The manifests are rendered by the real ``kubectl kustomize`` (tests/deploy/kustomize.py):
what kustomize refuses fails with its own message."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.kustomize import KustomizeError, made_name, render

CM = "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndata: {a: b}\n"


def test_kustomize_renders_and_refuses_as_kustomize_does(tmp_path: Path) -> None:
    (tmp_path / "cm.yaml").write_text(CM)
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [cm.yaml]\nconfigMapGenerator: [{name: env, literals: [A=1]}]\n"
    )
    names = sorted(made_name(o) for o in render(tmp_path))
    assert names[1] == "x" and names[0].startswith("env-")  # a generated name: a hash suffix
    (tmp_path / "kustomization.yaml").write_text("resources: [cm.yaml, ../outside.yaml]\n")
    with pytest.raises(KustomizeError, match=r"outside\.yaml"):
        render(tmp_path)
