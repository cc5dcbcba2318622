"""Where the deployment files are, and the constants the deployment tests hold them to."""

from __future__ import annotations

from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parents[2]
DEPLOY: Final = ROOT / "deploy"
K8S: Final = DEPLOY / "k8s"
BASE: Final = K8S / "base"
OVERLAYS: Final = {name: K8S / "overlays" / name for name in ("cpu-demo", "gpu")}
MONITORING: Final = K8S / "monitoring"
IMAGES: Final = DEPLOY / "images"
HELM_VALUES: Final = DEPLOY / "nats" / "helm-values.yaml"
COLLECTOR_CONFIG: Final = DEPLOY / "observability" / "otel-collector.yaml"
COMPOSE: Final = DEPLOY / "observability" / "docker-compose.yaml"
PROBE_SCRIPT: Final = BASE / "probe" / "worker_probe.py"
OPERATING_DOC: Final = ROOT / "docs" / "operating.md"
CODE_DIRS: Final = (ROOT / "services", ROOT / "connector")

# The Kubernetes versions whose schemas every object must satisfy (kubernetes-validate ships
# them; "1.30" is the oldest release the manifests claim, "1.37" the newest the package knows).
K8S_VERSIONS: Final = ("1.30", "1.37")
NAMESPACE: Final = "kvpush"
KVPUSH_IMAGES: Final = ("kvpush", "kvpush-cuda")
WORKERS: Final = ("prefill", "decode")
ROLES: Final = ("gateway", *WORKERS)
VENV_PYTHON: Final = "/opt/venv/bin/python"  # the images' interpreter; the probes call it
IMAGE_UID: Final = 10001
