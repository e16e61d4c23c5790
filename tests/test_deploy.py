"""The deployment manifests parse and wire the probes to the server's health routes."""

from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def test_manifests_probe_the_v2_health_routes() -> None:
    docs = {
        d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "k8s" / "deployment.yaml").read_text())
    }
    assert set(docs) >= {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget"}
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    grace = docs["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    server_grace = int(dockerfile.split('"--grace-period", "')[1].split('"')[0])
    assert server_grace < grace, "pod grace period must outlast the server's drain"
