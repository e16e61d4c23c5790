"""What deploy/ ships: manifests that parse and agree with each other (names, labels, ports,
metrics), a Prometheus configuration promtool accepts, and a readiness probe that follows
the server's model state."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from examples.build_repository import MLP_CONFIG
from tests.cache_fixtures import free_port
from tests.conftest import ROOT
from tests.metrics_load import sample_names

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
PROMETHEUS = DEPLOY / "prometheus"
PROMTOOL = shutil.which("promtool")
KUBECTL = shutil.which("kubectl")


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _by_kind(*names: str) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for name in names for d in _docs(K8S / name)}


def _metric_names(text: str) -> set[str]:
    return set(re.findall(r"\brtserve_[a-z_]+\b", text))


def test_every_manifest_parses_and_names_its_object() -> None:
    files = sorted(K8S.glob("*.yaml"))
    assert {f.name for f in files} >= {
        "deployment.yaml", "hpa.yaml", "keda-scaledobject.yaml", "podmonitor.yaml",
        "prometheusrule.yaml", "prometheus-adapter-values.yaml",
    }  # fmt: skip
    for f in files:
        for doc in _docs(f):
            if f.name.endswith("-values.yaml"):  # Helm values, not an object
                continue
            assert doc["apiVersion"] and doc["kind"], f
            assert doc["metadata"]["name"] == "rtserve", f"{f.name}: {doc['metadata']}"
    for f in [*DEPLOY.rglob("*.yml"), DEPLOY / "kustomization.yaml"]:
        assert _docs(f), f


def test_manifests_probe_the_v2_health_routes() -> None:
    docs = _by_kind("deployment.yaml")
    assert set(docs) == {"Deployment", "Service", "PodDisruptionBudget"}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    ports = {p["name"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] in ports
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    server_grace = int(dockerfile.split('"--grace-period", "')[1].split('"')[0])
    assert server_grace < pod["terminationGracePeriodSeconds"], (
        "pod grace period must outlast the server's drain"
    )
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", dockerfile, re.M)[1].split()}  # type: ignore[index]
    assert exposed == {p["containerPort"] for p in container["ports"]}


def test_selectors_labels_and_ports_agree() -> None:
    docs = _by_kind("deployment.yaml", "podmonitor.yaml")
    deployment = docs["Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert docs["Service"]["spec"]["selector"].items() <= labels.items()
    assert docs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert docs["PodMonitor"]["spec"]["selector"]["matchLabels"].items() <= labels.items()

    container = deployment["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {p["targetPort"] for p in docs["Service"]["spec"]["ports"]} <= set(ports)
    endpoint = docs["PodMonitor"]["spec"]["podMetricsEndpoints"][0]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == ports["http"]
    assert annotations["prometheus.io/path"] == "/metrics"


def test_autoscalers_scale_the_deployment_on_served_traffic() -> None:
    deployment = _by_kind("deployment.yaml")["Deployment"]["metadata"]["name"]
    hpa = _by_kind("hpa.yaml")["HorizontalPodAutoscaler"]
    keda = _by_kind("keda-scaledobject.yaml")["ScaledObject"]
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": deployment,
    }  # fmt: skip
    assert keda["spec"]["scaleTargetRef"]["name"] == deployment
    assert all(m["type"] == "Pods" for m in hpa["spec"]["metrics"]), "no CPU-only scaling"

    # Every metric the HPA asks for is one the adapter serves, built from rtserve's series.
    adapter = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    served = {r["name"]["as"]: r for r in adapter["rules"]["custom"]}
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    assert wanted == set(served) == {"rtserve_queue_depth", "rtserve_requests_per_second"}
    for rule in served.values():
        assert "<<.LabelMatchers>>" in rule["metricsQuery"]
        assert set(rule["resources"]["overrides"]) == {"namespace", "pod"}
    # The KEDA triggers scale on the same two signals with the same per-pod targets.
    targets = {
        m["pods"]["metric"]["name"]: m["pods"]["target"]["averageValue"]
        for m in hpa["spec"]["metrics"]
    }
    triggers = keda["spec"]["triggers"]
    assert [t["type"] for t in triggers] == ["prometheus", "prometheus"]
    assert "rtserve_queue_depth" in triggers[0]["metadata"]["query"]
    assert triggers[0]["metadata"]["threshold"] == targets["rtserve_queue_depth"]
    assert "rtserve_requests_total" in triggers[1]["metadata"]["query"]
    assert triggers[1]["metadata"]["threshold"] == targets["rtserve_requests_per_second"]


def test_prometheus_scrape_labels_feed_the_adapter() -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert config["rule_files"] == ["rtserve-rules.yml"]
    relabel = config["scrape_configs"][0]["relabel_configs"]
    targets = {r.get("target_label") for r in relabel}
    assert {"namespace", "pod", "__metrics_path__", "__address__"} <= targets


def test_prometheus_rule_resource_holds_the_rules_file() -> None:
    rule = _by_kind("prometheusrule.yaml")["PrometheusRule"]
    rules = yaml.safe_load((PROMETHEUS / "rtserve-rules.yml").read_text())
    assert rule["spec"]["groups"] == rules["groups"], (
        "regenerate: python deploy/prometheus/prometheusrule.py > deploy/k8s/prometheusrule.yaml"
    )
    generated = subprocess.run(
        [sys.executable, str(PROMETHEUS / "prometheusrule.py")],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    assert generated == (K8S / "prometheusrule.yaml").read_text()


def test_configured_queue_capacity_matches_the_example_model() -> None:
    rules = yaml.safe_load((PROMETHEUS / "rtserve-rules.yml").read_text())
    capacity = {
        r["labels"]["model"]: float(r["expr"].removeprefix("vector(").removesuffix(")"))
        for g in rules["groups"]
        for r in g["rules"]
        if r.get("record") == "rtserve:queue_capacity:configured"
    }
    example = yaml.safe_load(MLP_CONFIG)["dynamic_batching"]["max_queue_size"]
    assert capacity == {"mlp": example}


def test_kustomization_lists_existing_files() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    files = list(kustomization["resources"])
    for generator in kustomization["configMapGenerator"]:
        files += generator["files"]
    for f in files:
        assert (DEPLOY / f).is_file(), f
    if KUBECTL is None:
        return
    r = subprocess.run(
        [KUBECTL, "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    built = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(r.stdout)}
    assert built == {
        ("Deployment", "rtserve"), ("Service", "rtserve"), ("PodDisruptionBudget", "rtserve"),
        ("HorizontalPodAutoscaler", "rtserve"), ("ConfigMap", "rtserve-prometheus"),
        ("ConfigMap", "rtserve-grafana-dashboard"),
    }  # fmt: skip


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
def test_promtool_accepts_the_prometheus_configs(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    local = subprocess.run(
        [PROMTOOL, "check", "config", str(PROMETHEUS / "prometheus-local.yml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert local.returncode == 0, local.stdout + local.stderr
    # Debian's promtool is built without Kubernetes discovery: check the rest of the in-cluster
    # config (relabelling, rule files) with the discovery swapped for a static target.
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    for job in config["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
        job["static_configs"] = [{"targets": ["127.0.0.1:8000"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(PROMETHEUS / "rtserve-rules.yml", tmp_path)
    cluster = subprocess.run(
        [PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cluster.returncode == 0, cluster.stdout + cluster.stderr


SLOW_LOAD_MODEL = """
import time
import numpy as np

class Model:
    def load(self, context):
        time.sleep(2.5)

    def infer(self, inputs):
        return {"y": inputs["x"] * 2}
"""


def test_readiness_follows_model_state_and_scaling_metrics_exist(tmp_path: Path) -> None:
    """The probe's route answers 503 while the model loads, 200 once it serves; the series
    the autoscalers read are on /metrics."""
    model = tmp_path / "repo" / "slowload"
    (model / "1").mkdir(parents=True)
    (model / "1" / "model.py").write_text(SLOW_LOAD_MODEL)
    (model / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "backend": "python",
                "max_batch_size": 4,
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
                "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}],
            }
        )
    )
    port = free_port()
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "rtserve.cli", "serve", "--model-repository",
            str(tmp_path / "repo"), "--host", "127.0.0.1", "--http-port", str(port),
            "--grpc-port", "0",
        ],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
    )  # fmt: skip
    seen: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not seen or seen[-1] != 200):
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            with contextlib.suppress(httpx.TransportError):  # not listening yet
                seen.append(httpx.get(f"http://127.0.0.1:{port}/v2/health/ready").status_code)
            time.sleep(0.05)
        assert seen and seen[-1] == 200, (seen[-5:], (tmp_path / "server.log").read_text())
        assert 503 in seen, "readiness was never false while the model loaded"
        assert set(seen) == {503, 200}
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/v2/models/slowload/ready").status_code == 200
        body = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}
        assert httpx.post(f"{base}/v2/models/slowload/infer", json=body).status_code == 200
        exposed = sample_names(httpx.get(f"{base}/metrics").text)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    adapter = (K8S / "prometheus-adapter-values.yaml").read_text()
    keda = (K8S / "keda-scaledobject.yaml").read_text()
    read = _metric_names(adapter) | _metric_names(keda)
    read.discard("rtserve_requests_per_second")  # the adapter's name for a rate, not a series
    assert read == {"rtserve_queue_depth", "rtserve_requests_total"}
    assert read <= exposed
