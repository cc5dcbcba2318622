"""The small kustomize of tests/deploy_k8s/kustomize_lite.py: it refuses what it does not
implement (so a manifest it cannot render fails rather than renders wrong), and merges patches,
generators and images as kustomize does."""

from __future__ import annotations

from pathlib import Path
from typing import Final

import pytest

from tests.deploy_k8s.kustomize_lite import KustomizeError, made_name, render
from tests.deploy_k8s.manifests import generated_data, main_container, named, of_kind


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
