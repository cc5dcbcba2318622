"""The deploy tier: tests of deploy/k8s/, deploy/images/, deploy/observability/ and
deploy/nats/helm-values.yaml, and their helpers (``make test-docs`` runs this folder).

No cluster and no Docker engine run here, so these tests stand in for `kubectl apply -k` and
`docker build`; the manifests are rendered by the real ``kubectl kustomize`` (a subprocess per
kustomization: kubectl must be on PATH, a missing one fails the tests that render). No engine
and no nats-server start here (the workers' probe against a real nats-server is
tests/integration/test_k8s_worker_probe.py). Everything runs in the pytest process's thread.
The helpers:

- ``layout``: the paths and constants those tests check against.
- ``kustomize``: ``render``, the manifests as ``kubectl kustomize`` renders them.
- ``manifests``: lookups over rendered objects and the files next to them (Helm values, the
  project version, the code's KVPUSH_* variables).
- ``schemas``: validation against the Kubernetes OpenAPI schemas and the ServiceMonitor subset.
- ``checks``: the cross-object checks (each returns its problems).
- ``dockerfiles``: Dockerfile, .dockerignore and Makefile parsing.
"""
