"""Helpers for the tests of deploy/k8s/, deploy/images/ and deploy/nats/helm-values.yaml.

No cluster, no kustomize binary and no Docker engine run here, so the tests under
tests/unit/test_deploy_k8s_*.py stand in for `kubectl apply -k` and `docker build`. The helpers:

- ``layout``: the paths and constants those tests check against.
- ``kustomize``: ``render``, the manifests as ``kubectl kustomize`` renders them.
- ``manifests``: lookups over rendered objects and the files next to them (Helm values, the
  project version, the code's KVPUSH_* variables).
- ``schemas``: validation against the Kubernetes OpenAPI schemas and the ServiceMonitor subset.
- ``checks``: the cross-object checks (each returns its problems).
- ``dockerfiles``: Dockerfile, .dockerignore and Makefile parsing.
"""
