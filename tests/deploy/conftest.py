"""The deploy tier's shared fixture: each kustomization of deploy/k8s/ as ``kubectl kustomize``
renders it (one render per module and kustomization; the pytest process's thread)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.manifests import RENDERED, render_applied


@pytest.fixture(scope="module", params=sorted(RENDERED))
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    """(name, objects) of one kustomization, with what it is applied next to."""
    return request.param, render_applied(request.param)
