"""What deploy/ ships: manifests that parse and agree with each other (names, labels, ports,
metrics), a Prometheus configuration promtool accepts, and a readiness probe that follows
the server's model state."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import ssl
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
from tests.conftest import ROOT, start_server
from tests.metrics_load import sample_names
from tests.models import build_scale, write_config, write_python_model

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
        "prometheusrule.yaml", "prometheus-adapter-values.yaml", "pvc.yaml",
        "models-loader.yaml", "podmonitor-auth-tls.yaml",
    }  # fmt: skip
    for f in files:
        for doc in _docs(f):
            if f.name.endswith("-values.yaml"):  # Helm values, not an object
                continue
            assert doc["apiVersion"] and doc["kind"], f
            name = doc["metadata"]["name"]
            assert name == "rtserve" or name.startswith("rtserve-"), f"{f.name}: {name}"
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
    # SIGTERM waits for the preStop sleep: endpoints drop the pod before it starts refusing.
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and int(command[1]) >= 5, command
    assert int(command[1]) + server_grace < pod["terminationGracePeriodSeconds"], (
        "pod grace period must outlast the preStop sleep and the server's drain"
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
    assert "rtserve_client_requests_total" in triggers[1]["metadata"]["query"]
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
        ("PersistentVolumeClaim", "rtserve-models"),
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
    _check_config(config, tmp_path)


def _check_config(config: dict[str, Any], tmp: Path) -> None:
    """``promtool check config`` on ``config`` written beside rtserve's rules file."""
    assert PROMTOOL is not None
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(PROMETHEUS / "rtserve-rules.yml", tmp)
    checked = subprocess.run(
        [PROMTOOL, "check", "config", str(tmp / "prometheus.yml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert checked.returncode == 0, checked.stdout + checked.stderr


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
    config = {
        "backend": "python",
        "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [2]}],
    }
    write_python_model(tmp_path / "repo", "slowload", config, SLOW_LOAD_MODEL)
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
    assert read == {"rtserve_queue_depth", "rtserve_client_requests_total"}
    assert read <= exposed


# ---------------------------------------------------------------------- model repository PVC
def _fill_command() -> str:
    """deploy/README.md's command that copies a repository into the claim."""
    readme = (DEPLOY / "README.md").read_text()
    found = re.search(r"^(tar -C examples/repository .*)$", readme, re.M)
    assert found, "deploy/README.md: no tar ... | kubectl exec ... fill command"
    return found[1]


def test_the_models_claim_is_the_one_the_pods_and_the_loader_mount() -> None:
    claim = _by_kind("pvc.yaml")["PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # pods on several nodes
    pod = _by_kind("deployment.yaml")["Deployment"]["spec"]["template"]["spec"]
    loader = _by_kind("models-loader.yaml")["Pod"]["spec"]
    for spec, read_only in ((pod, True), (loader, False)):
        volume = next(v for v in spec["volumes"] if "persistentVolumeClaim" in v)
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        mount = next(
            m for c in spec["containers"] for m in c["volumeMounts"] if m["name"] == volume["name"]
        )
        assert mount["mountPath"] == "/models" and mount.get("readOnly", False) is read_only
    command = _fill_command()
    assert "kubectl exec -i rtserve-models-loader -- tar -C /models -xf -" in command
    assert command in (K8S / "models-loader.yaml").read_text()


def test_the_fill_command_lays_out_a_repository_that_serves(tmp_path: Path) -> None:
    """The README's tar pipeline, with the pod's side run here: models land at the top of
    /models (not in a subdirectory), and a server on that directory is ready."""
    if not (ROOT / "examples" / "repository" / ".built").exists():
        pytest.skip("examples/repository is not built (make examples)")
    volume = tmp_path / "models"
    volume.mkdir()
    local = _fill_command().replace(
        "kubectl exec -i rtserve-models-loader -- tar -C /models", f"tar -C {volume}"
    )
    subprocess.run(local, shell=True, check=True, cwd=ROOT, timeout=120)
    assert (volume / "text-embedding" / "config.yaml").is_file()
    s = start_server(volume, tmp_path / "s", timeout=180)  # strict: every model loaded
    s.stop()


# ---------------------------------------------------------------------- scraping auth + TLS
def _auth_tls_config(tmp: Path, ca: Path, token: Path, server_name: str) -> dict[str, Any]:
    """prometheus-auth-tls.yml with its Secret paths and server_name pointed at ``tmp``."""
    config = yaml.safe_load((PROMETHEUS / "prometheus-auth-tls.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["scheme"] == "https" and job["authorization"]["type"] == "Bearer"
    assert job["tls_config"]["server_name"] and job["tls_config"]["ca_file"]
    job["tls_config"].update(ca_file=str(ca), server_name=server_name)
    job["authorization"]["credentials_file"] = str(token)
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
    job["static_configs"] = [{"targets": ["127.0.0.1:8000"]}]
    return config


def _scrape(port: int, server_name: str, ca: Path, token: str | None) -> tuple[int, bytes]:
    """GET /metrics as the scrape job sends it: TLS checked against ``ca`` for
    ``server_name``, ``Authorization: Bearer <token>``."""
    ctx = ssl.create_default_context(cafile=str(ca))
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname=server_name) as tls,
    ):
        tls.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n\r\n".encode())
        answer = b""
        while chunk := tls.recv(65536):
            answer += chunk
    return int(answer.split(b" ", 2)[1]), answer


def test_the_auth_and_tls_scrape_config_reads_a_secured_server(tmp_path: Path) -> None:
    from tests.test_security import make_cert

    cert, key = make_cert(tmp_path)  # signed for 127.0.0.1 and localhost
    token = "scrape-token-0123456789abcdef"
    (tmp_path / "token").write_text(token + "\n")
    (tmp_path / "auth.yaml").write_text(
        yaml.safe_dump(
            {
                "keys": [
                    {"name": "prometheus", "token_file": str(tmp_path / "token"), "admin": True},
                    {"name": "app", "token": "app-token-0123456789abcdef", "models": "*"},
                ]
            }
        )
    )
    config = _auth_tls_config(tmp_path, cert, tmp_path / "token", "localhost")
    if PROMTOOL is not None:
        _check_config(config, tmp_path)
    repo = tmp_path / "repo"
    build_scale(repo / "m" / "1" / "model.onnx", 2.0)
    (repo / "m" / "config.yaml").write_text("max_batch_size: 4\n")
    s = start_server(
        repo, tmp_path / "s",
        "--tls-cert", str(cert), "--tls-key", str(key), "--auth-file", str(tmp_path / "auth.yaml"),
        tls=ssl.create_default_context(cafile=str(cert)),
    )  # fmt: skip
    try:
        job = config["scrape_configs"][0]
        credentials = Path(job["authorization"]["credentials_file"]).read_text().strip()
        server_name, ca = job["tls_config"]["server_name"], Path(job["tls_config"]["ca_file"])
        status, body = _scrape(s.http_port, server_name, ca, credentials)
        assert status == 200 and b"rtserve_queue_depth" in body
        assert _scrape(s.http_port, server_name, ca, None)[0] == 401
        assert _scrape(s.http_port, server_name, ca, "app-token-0123456789abcdef")[0] == 403
    finally:
        s.stop()


def test_the_auth_tls_podmonitor_scrapes_like_the_plain_one() -> None:
    plain = _by_kind("podmonitor.yaml")["PodMonitor"]["spec"]
    secure = _by_kind("podmonitor-auth-tls.yaml")["PodMonitor"]["spec"]
    assert secure["selector"] == plain["selector"]
    endpoint = secure["podMetricsEndpoints"][0]
    assert {k: endpoint[k] for k in ("port", "path")} == {"port": "http", "path": "/metrics"}
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"]["serverName"]
    assert endpoint["tlsConfig"]["ca"]["secret"]["key"] == "ca.crt"
    assert endpoint["authorization"]["type"] == "Bearer"
    assert endpoint["authorization"]["credentials"]["key"] == "token"


# ---------------------------------------------------------------------- autoscaling metric
def _totals(base: str, names: set[str]) -> dict[str, float]:
    """Each metric's value summed over every label set (what sum(...) in a query sees)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def _scaling_series() -> set[str]:
    """The counters the requests-per-second autoscalers take a rate of."""
    adapter = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    rule = next(
        r for r in adapter["rules"]["custom"] if r["name"]["as"] == "rtserve_requests_per_second"
    )
    keda = _by_kind("keda-scaledobject.yaml")["ScaledObject"]["spec"]["triggers"]
    query = next(t for t in keda if t["name"] == "requests-per-second")["metadata"]["query"]
    names = {
        *re.findall(r"rate\((rtserve_[a-z_]+)\{", rule["metricsQuery"]),
        *re.findall(r"rate\((rtserve_[a-z_]+)\{", query),
    }
    assert len(names) == 1, names
    return names


def test_requests_per_second_counts_a_pipeline_request_once(tmp_path: Path) -> None:
    """A 2-step ensemble (double, then triple): 5 requests raise the autoscalers' series by 5,
    while rtserve_requests_total (the ensemble and each step) rises by 15."""
    repo = tmp_path / "repo"
    for name, factor in (("double", 2.0), ("triple", 3.0)):
        build_scale(repo / name / "1" / "model.onnx", factor)
        (repo / name / "config.yaml").write_text("max_batch_size: 4\n")
    pipeline = {
        "backend": "ensemble",
        "max_batch_size": 4,
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "Y", "datatype": "FP32", "shape": [4]}],
        "steps": [
            {"model": "double", "inputs": {"x": "X"}, "outputs": {"y": "X2"}},
            {"model": "triple", "inputs": {"x": "X2"}, "outputs": {"y": "Y"}},
        ],
    }
    write_config(repo, "pipeline", pipeline)
    (series,) = _scaling_series()
    names = {series, "rtserve_requests_total"}
    s = start_server(repo, tmp_path / "s")
    try:
        before = _totals(s.base, names)
        body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": [1] * 4}]}
        for _ in range(5):
            r = httpx.post(f"{s.base}/v2/models/pipeline/infer", json=body)
            assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [6.0] * 4
        after = _totals(s.base, names)
    finally:
        s.stop()
    assert after[series] - before[series] == 5
    assert after["rtserve_requests_total"] - before["rtserve_requests_total"] == 15


def _quantity(text: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * factor)
    return int(text)


def test_the_llm_deployment_probes_and_sizes_memory_for_its_kv_pool() -> None:
    """deploy/k8s/llm-deployment.yaml: the V2 health probes, a startup allowance for loading
    the model and building the kernels, and memory for the weights plus the example's KV
    pool (the measured 2.0 GiB RSS) within the limit."""
    from examples.build_llm import LLM_CONFIG

    docs = _by_kind("llm-deployment.yaml")
    assert set(docs) == {"Deployment", "Service", "PersistentVolumeClaim"}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120
    labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert docs["Service"]["spec"]["selector"].items() <= labels.items()
    assert (
        pod["volumes"][0]["persistentVolumeClaim"]["claimName"]
        == (docs["PersistentVolumeClaim"]["metadata"]["name"])
    )
    pool = yaml.safe_load(LLM_CONFIG)["llm"]["kv_cache_bytes"]
    weights = 538 * 10**6  # SmolLM2-135M FP32 safetensors
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    assert _quantity(requests["memory"]) >= weights + pool + (1 << 30)  # + packed copies, torch
    assert _quantity(limits["memory"]) >= _quantity(requests["memory"])
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "--build-arg EXTRAS=llm" in dockerfile and "*,llm,*" in dockerfile
    exposed = {int(p) for p in re.search(r"^EXPOSE (.+)$", dockerfile, re.M)[1].split()}  # type: ignore[index]
    assert exposed == {p["containerPort"] for p in container["ports"]}
