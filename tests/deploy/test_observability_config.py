"""The observability deployment (deploy/observability/): every file parses, and the files agree
with each other and with the gateway's metric names.

No Docker engine runs here, so these checks stand in for `docker compose up`: YAML and dashboard
JSON parse; every panel has a place and a provisioned datasource; every PromQL name is one of
``DASHBOARD_METRICS``; the collector's pipelines use only declared components; the compose file
mounts files that exist at the paths the configs name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import pytest
import yaml

from kvpush.services.telemetry.breakdown import PART_NAMES

ROOT: Final = Path(__file__).resolve().parents[2]
OBS: Final = ROOT / "deploy" / "observability"
DASHBOARDS: Final = OBS / "grafana" / "dashboards"
DATASOURCES: Final = OBS / "grafana" / "provisioning" / "datasources" / "datasources.yaml"
PROVIDERS: Final = OBS / "grafana" / "provisioning" / "dashboards" / "dashboards.yaml"
COMPOSE: Final = OBS / "docker-compose.yaml"
COLLECTOR: Final = OBS / "otel-collector.yaml"
DOC: Final = ROOT / "docs" / "observability.md"

# The gateway's metric families the dashboards query, by the name and type of their
# ``# TYPE`` line in /metrics (prometheus-client: counters end in _total; a histogram ``H``
# exposes H_bucket, H_sum and H_count). Every dashboard PromQL name must be one of these (or a
# histogram's series) and every entry must be used by a dashboard; a live test can compare this
# table with the ``# TYPE`` lines of a running gateway.
DASHBOARD_METRICS: Final[dict[str, str]] = {
    "kvpush_gateway_requests_total": "counter",
    "kvpush_gateway_requests_in_flight": "gauge",
    "kvpush_gateway_time_to_first_token_seconds": "histogram",
    "kvpush_gateway_time_per_output_token_seconds": "histogram",
    "kvpush_gateway_request_duration_seconds": "histogram",
    "kvpush_gateway_ttft_part_seconds": "histogram",
    "kvpush_gateway_prompt_tokens_total": "counter",
    "kvpush_gateway_completion_tokens_total": "counter",
    "kvpush_gateway_routed_requests_total": "counter",
    "kvpush_gateway_aborts_total": "counter",
    "kvpush_kv_transfer_bytes_total": "counter",
    "kvpush_kv_transfer_seconds": "histogram",
    "kvpush_kv_transfers_total": "counter",
    "kvpush_kv_transfer_failures_total": "counter",
    "kvpush_worker_free_blocks": "gauge",
    "kvpush_worker_total_blocks": "gauge",
    "kvpush_worker_queue_depth": "gauge",
    "kvpush_worker_in_flight": "gauge",
    "kvpush_gateway_workers": "gauge",
    "kvpush_gateway_token_chunks_total": "counter",
    "kvpush_gateway_route_decisions_total": "counter",
    "kvpush_gateway_route_decision_seconds": "histogram",
}
HISTOGRAM_SERIES: Final = ("_bucket", "_sum", "_count")
METRIC_NAME: Final = re.compile(r"kvpush_[a-z_]+")
PIPELINE_TYPES: Final = ("traces", "metrics", "logs")


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def load_dashboard(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, including those inside collapsed rows."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def data_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    return (p for p in all_panels(dashboard["panels"]) if p.get("type") != "row")


def provisioned_datasources() -> dict[str, dict[str, Any]]:
    return {ds["uid"]: ds for ds in load_yaml(DATASOURCES)["datasources"]}


def prometheus_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every Prometheus target and query variable of ``dashboard``."""
    prometheus = {
        uid for uid, ds in provisioned_datasources().items() if ds["type"] == "prometheus"
    }
    for panel in data_panels(dashboard):
        for target in panel.get("targets", []):
            uid = (target.get("datasource") or panel["datasource"])["uid"]
            if uid in prometheus:
                yield f"panel {panel['title']!r} {target['refId']}", target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query" and variable["datasource"]["uid"] in prometheus:
            query = variable["query"]
            yield (
                f"variable {variable['name']}",
                query["query"] if isinstance(query, dict) else query,
            )


def family_of(series: str) -> str | None:
    """The ``DASHBOARD_METRICS`` family a series name belongs to, or None."""
    if DASHBOARD_METRICS.get(series) in ("counter", "gauge"):
        return series
    for suffix in HISTOGRAM_SERIES:
        base = series.removesuffix(suffix)
        if base != series and DASHBOARD_METRICS.get(base) == "histogram":
            return base
    return None


def components(section: str) -> set[str]:
    return set(load_yaml(COLLECTOR).get(section) or {})


def compose_mounts() -> dict[str, list[tuple[str, str]]]:
    """service -> [(source, target)] of its volume entries ("src:dst[:mode]")."""
    services = load_yaml(COMPOSE)["services"]
    return {
        name: [tuple(entry.split(":")[:2]) for entry in service.get("volumes", [])]
        for name, service in services.items()
    }


def flag_value(args: list[str], flag: str) -> str:
    """The value of ``flag=VALUE`` in a command list."""
    values = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    assert len(values) == 1, f"{flag} given {len(values)} times in {args}"
    return values[0]


# ---- parsing ---------------------------------------------------------------------------------


def test_every_yaml_file_parses_to_a_mapping() -> None:
    files = sorted([*OBS.rglob("*.yaml"), *OBS.rglob("*.yml")])
    assert {p.relative_to(OBS).as_posix() for p in files} >= {
        "otel-collector.yaml",
        "prometheus.yml",
        "tempo.yaml",
        "docker-compose.yaml",
        "grafana/provisioning/datasources/datasources.yaml",
        "grafana/provisioning/dashboards/dashboards.yaml",
    }
    for path in files:
        assert isinstance(load_yaml(path), dict), path


def test_dashboards_are_grafana_dashboard_json() -> None:
    files = dashboard_files()
    assert [p.name for p in files] == ["kvpush-fleet.json", "kvpush-ttft.json"]
    uids = set()
    for path in files:
        dashboard = load_dashboard(path)
        assert dashboard["title"].startswith("kvpush — "), path
        assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
        assert "kvpush" in dashboard["tags"]
        assert dashboard["uid"] not in uids and len(dashboard["uid"]) <= 40
        uids.add(dashboard["uid"])
        ids = [p["id"] for p in all_panels(dashboard["panels"])]
        assert len(ids) == len(set(ids)), f"{path.name}: duplicate panel ids"
        assert "__inputs" not in dashboard, f"{path.name}: exported with inputs, not provisionable"


def test_every_panel_has_a_grid_position_inside_the_24_columns_without_overlap() -> None:
    for path in dashboard_files():
        taken: dict[tuple[int, int], str] = {}
        for panel in all_panels(load_dashboard(path)["panels"]):
            where = f"{path.name}: {panel.get('title')!r}"
            grid = panel["gridPos"]
            assert all(isinstance(grid[k], int) for k in "hwxy"), where
            assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] >= 0, where
            assert grid["x"] + grid["w"] <= 24, where
            for row in range(grid["y"], grid["y"] + grid["h"]):
                for column in range(grid["x"], grid["x"] + grid["w"]):
                    assert (row, column) not in taken, f"{where} overlaps {taken[row, column]}"
                    taken[row, column] = str(panel.get("title"))


def test_every_panel_and_target_uses_a_provisioned_datasource_uid() -> None:
    provisioned = provisioned_datasources()
    assert {ds["type"] for ds in provisioned.values()} == {"prometheus", "tempo"}
    for path in dashboard_files():
        dashboard = load_dashboard(path)
        for panel in data_panels(dashboard):
            where = f"{path.name}: {panel['title']!r}"
            source = panel["datasource"]
            assert source["uid"] in provisioned, where
            assert source["type"] == provisioned[source["uid"]]["type"], where
            assert panel["targets"], where
            for target in panel["targets"]:
                own = target.get("datasource", source)
                assert own["uid"] in provisioned, f"{where} {target['refId']}"
                assert own["type"] == provisioned[own["uid"]]["type"], f"{where} {target['refId']}"
        for variable in dashboard["templating"]["list"]:
            if "datasource" in variable:
                assert variable["datasource"]["uid"] in provisioned, variable["name"]


def test_promql_names_are_dashboard_metrics_and_every_one_is_used() -> None:
    used: set[str] = set()
    for path in dashboard_files():
        for where, expr in prometheus_queries(load_dashboard(path)):
            for name in METRIC_NAME.findall(expr):
                family = family_of(name)
                assert family is not None, f"{path.name} {where}: {name} is not a gateway series"
                used.add(family)
    assert used == set(DASHBOARD_METRICS), f"listed but unused: {set(DASHBOARD_METRICS) - used}"


def test_histograms_are_read_through_their_buckets_by_le() -> None:
    for path in dashboard_files():
        for where, expr in prometheus_queries(load_dashboard(path)):
            if "histogram_quantile" in expr:
                assert "_bucket" in expr and re.search(r"by \(le\b", expr), f"{where}: {expr}"
                assert "[$__rate_interval]" in expr, f"{where}: fixed rate window"


def test_ttft_dashboard_covers_every_breakdown_part_in_path_order() -> None:
    dashboard = load_dashboard(DASHBOARDS / "kvpush-ttft.json")
    exprs = [expr for _, expr in prometheus_queries(dashboard)]
    assert any(
        "kvpush_gateway_ttft_part_seconds_bucket" in e and "by (le, part)" in e for e in exprs
    )
    for panel in data_panels(dashboard):
        parts = [
            m.group(1)
            for t in panel["targets"]
            if (m := re.search(r'part="([a-z_]+)"', t.get("expr", "")))
        ]
        if parts:
            assert tuple(parts) == PART_NAMES, panel["title"]


def test_ttft_dashboard_searches_the_request_root_spans_in_tempo() -> None:
    dashboard = load_dashboard(DASHBOARDS / "kvpush-ttft.json")
    tempo = [
        t
        for p in data_panels(dashboard)
        if p["datasource"]["type"] == "tempo" and p["type"] == "table"
        for t in p["targets"]
    ]
    assert tempo and tempo[0]["queryType"] == "traceql"
    assert re.fullmatch(r'\{\s*name\s*=\s*"gateway\.request"\s*\}', tempo[0]["query"])


# ---- Grafana provisioning -------------------------------------------------------------------


def test_tempo_datasource_links_traces_to_prometheus() -> None:
    provisioned = provisioned_datasources()
    tempo = next(ds for ds in provisioned.values() if ds["type"] == "tempo")
    prometheus = next(ds for ds in provisioned.values() if ds["type"] == "prometheus")
    data = tempo["jsonData"]
    assert data["tracesToMetrics"]["datasourceUid"] == prometheus["uid"]
    assert data["serviceMap"]["datasourceUid"] == prometheus["uid"]
    for query in data["tracesToMetrics"]["queries"]:
        # `$$` is a literal `$` in provisioning files; a bare `$__tags` would be env-expanded.
        assert "$$__tags" in query["query"] and "kvpush_" not in query["query"]
    exemplar = prometheus["jsonData"]["exemplarTraceIdDestinations"][0]
    assert exemplar["datasourceUid"] == tempo["uid"]


def test_datasource_urls_name_compose_services_and_their_ports() -> None:
    services = load_yaml(COMPOSE)["services"]
    tempo_port = load_yaml(OBS / "tempo.yaml")["server"]["http_listen_port"]
    ports = {"prometheus": 9090, "tempo": tempo_port}
    for ds in provisioned_datasources().values():
        match = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", ds["url"])
        assert match, ds["url"]
        assert match.group(1) in services and int(match.group(2)) == ports[match.group(1)]


def test_dashboard_provider_path_is_where_compose_mounts_the_dashboards() -> None:
    (provider,) = load_yaml(PROVIDERS)["providers"]
    mounts = dict(compose_mounts()["grafana"])
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    home = load_yaml(COMPOSE)["services"]["grafana"]["environment"][
        "GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"
    ]
    assert home == provider["options"]["path"] + "/kvpush-ttft.json"


# ---- collector ------------------------------------------------------------------------------


def test_collector_pipelines_use_only_declared_components() -> None:
    config = load_yaml(COLLECTOR)
    receivers, processors = components("receivers"), components("processors")
    exporters, connectors = components("exporters"), components("connectors")
    pipelines = config["service"]["pipelines"]
    assert set(config["service"].get("extensions", [])) <= components("extensions")
    as_exporter: set[str] = set()
    as_receiver: set[str] = set()
    for name, pipeline in pipelines.items():
        assert name.split("/")[0] in PIPELINE_TYPES, name
        assert pipeline["receivers"] and pipeline["exporters"], name
        assert set(pipeline["receivers"]) <= receivers | connectors, name
        assert set(pipeline.get("processors", [])) <= processors, name
        assert set(pipeline["exporters"]) <= exporters | connectors, name
        as_receiver |= set(pipeline["receivers"]) & connectors
        as_exporter |= set(pipeline["exporters"]) & connectors
        if pipeline.get("processors"):
            assert pipeline["processors"][0] == "memory_limiter", name
            assert pipeline["processors"][-1] == "batch", name
    assert connectors and as_exporter == as_receiver == connectors
    used = {c for p in pipelines.values() for c in p["exporters"]}
    assert "debug" in exporters and "debug" not in used, "the debug exporter is off by default"


def test_collector_listens_for_otlp_and_exports_to_tempo_over_grpc() -> None:
    config = load_yaml(COLLECTOR)
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert protocols["http"]["endpoint"] == "0.0.0.0:4318"
    (tempo_exporter,) = [k for k in config["exporters"] if k.split("/")[0] == "otlp_grpc"]
    exporter = config["exporters"][tempo_exporter]
    assert exporter["endpoint"] == "tempo:4317" and exporter["tls"]["insecure"] is True
    tempo = load_yaml(OBS / "tempo.yaml")
    tempo_grpc = tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert tempo_grpc.rsplit(":", 1)[1] == "4317"
    assert tempo["storage"]["trace"]["backend"] == "local"


def test_prometheus_scrapes_the_gateway_and_the_collector_ports() -> None:
    jobs = {j["job_name"]: j for j in load_yaml(OBS / "prometheus.yml")["scrape_configs"]}
    targets = {t for j in jobs.values() for c in j["static_configs"] for t in c["targets"]}
    assert "kvpush-gateway:8000" in targets
    assert jobs["kvpush-gateway"].get("metrics_path", "/metrics") == "/metrics"
    config = load_yaml(COLLECTOR)
    span_port = config["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]
    (reader,) = config["service"]["telemetry"]["metrics"]["readers"]
    self_port = reader["pull"]["exporter"]["prometheus"]["port"]
    assert {f"otel-collector:{span_port}", f"otel-collector:{self_port}"} <= targets
    services = load_yaml(COMPOSE)["services"]
    for target in targets:
        host = target.split(":")[0]
        assert host in services or host == "localhost" or host == "kvpush-gateway", target
    assert "kvpush-gateway:host-gateway" in services["prometheus"]["extra_hosts"]


# ---- compose --------------------------------------------------------------------------------


def test_compose_mounts_files_that_exist() -> None:
    named = set(load_yaml(COMPOSE).get("volumes") or {})
    for service, mounts in compose_mounts().items():
        for source, _ in mounts:
            if source.startswith("."):
                assert (OBS / source).exists(), f"{service}: {source} missing"
            else:
                assert source in named, f"{service}: {source} is not a declared volume"


def test_compose_points_each_program_at_its_mounted_config() -> None:
    services = load_yaml(COMPOSE)["services"]
    mounts = {name: dict(m) for name, m in compose_mounts().items()}
    expected = {
        "otel-collector": ("--config", "./otel-collector.yaml"),
        "tempo": ("-config.file", "./tempo.yaml"),
        "prometheus": ("--config.file", "./prometheus.yml"),
    }
    for service, (flag, source) in expected.items():
        assert flag_value(services[service]["command"], flag) == mounts[service][source], service


@pytest.mark.parametrize("service", ["otel-collector", "tempo", "prometheus", "grafana"])
def test_compose_images_are_pinned(service: str) -> None:
    image = load_yaml(COMPOSE)["services"][service]["image"]
    tag = image.rsplit(":", 1)[1] if ":" in image else ""
    assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{service}: {image} is not pinned"


# ---- docs ---------------------------------------------------------------------------------


def test_the_doc_names_every_part_metric_and_deploy_file() -> None:
    text = DOC.read_text(encoding="utf-8")
    for part in PART_NAMES:
        assert f"`{part}`" in text, part
    for name in DASHBOARD_METRICS:
        assert f"`{name}" in text, name
    for path in sorted(p for p in OBS.rglob("*") if p.is_file()):
        assert path.relative_to(OBS).as_posix() in text, path
