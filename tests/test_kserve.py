"""deploy/kserve (ServingRuntime, InferenceServices) and deploy/k8s validated offline.

Kubernetes kinds: kubernetes-validate's strict schemas (no unknown fields). KServe kinds: a
JSON Schema built from KServe's API types as its ``kserve`` wheel ships them
(tests/data/kserve-api-types.json, written by scripts/kserve_schema.py; the wheel holds no
CRD YAML), whose Kubernetes fields (containers, probes, resources) refer to those same
Kubernetes schemas. Other CRDs (KEDA, Prometheus operator) have no schema on PyPI: they are
named here so that a new core manifest can never be skipped silently."""

from __future__ import annotations

import copy
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

from rtserve.cli import build_parser
from tests.conftest import ROOT

DEPLOY = ROOT / "deploy"
KSERVE_TYPES = ROOT / "tests" / "data" / "kserve-api-types.json"
K8S_VERSION = kubernetes_validate.latest_version()
K8S_DEFS = "https://kubernetes.io/api/_definitions.json"
# CRDs whose schemas no PyPI package ships: structure is checked by test_deploy.py.
UNVALIDATED_CRDS = {"ScaledObject", "PodMonitor", "PrometheusRule"}
# Types the wheel names but does not define (Knative, KEDA, status, LLM serving): any value.
FREE_FORM = {
    "KnativeAddressable",
    "KnativeCondition",
    "KnativeDevServingPkgApisServingV1TrafficTarget",
    "KnativeURL",
    "GithubComKedacoreKedaV2ApisKedaV1alpha1ScaleTriggers",
    "V1alpha1LLMInferenceServiceSpec",
    "V1alpha1LLMInferenceServiceStatus",
    "V1alpha1LocalModelCacheStatus",
    "V1alpha1LocalModelInfo",
    "V1alpha1LocalModelNodeGroupStatus",
    "V1alpha1LocalModelNodeStatus",
    "V1alpha1TrainedModelStatus",
    "V1alpha1WorkerSpec",
    "V1alpha2LLMInferenceServiceSpec",
    "V1alpha2LLMInferenceServiceStatus",
    "V1beta1MetricQuantity",
}
# Kubernetes types the wheel names by their Go package path.
_K8S_PATHS = {
    "K8sIoApiAppsV1DeploymentStrategy": "io.k8s.api.apps.v1.DeploymentStrategy",
    "K8sIoApiAutoscalingV2HorizontalPodAutoscalerBehavior": (
        "io.k8s.api.autoscaling.v2.HorizontalPodAutoscalerBehavior"
    ),
}
_PRIMITIVES: dict[str, dict[str, Any]] = {
    "str": {"type": "string"},
    "int": {"type": "integer"},
    "float": {"type": "number"},
    "bool": {"type": "boolean"},
    "datetime": {"type": "string"},
    "object": {},
}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@cache
def _k8s_definitions() -> dict[str, Any]:
    path = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    defs = path / f"v{K8S_VERSION}-local-strict" / "_definitions.json"
    doc: dict[str, Any] = json.loads(defs.read_text())
    return doc


@cache
def _k8s_names() -> dict[str, str]:
    """Python client class name (``V1Container``) -> Kubernetes definition name."""
    names: dict[str, str] = {}
    for name in sorted(_k8s_definitions()["$defs"], key=lambda n: ("api.core" not in n, n)):
        version, kind = name.split(".")[-2:]
        names.setdefault(version[0].upper() + version[1:] + kind, name)
    return names


def _type(spec: str, classes: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema of one OpenAPI-generated field type."""
    if spec in _PRIMITIVES:
        return _PRIMITIVES[spec]
    if m := re.fullmatch(r"list\[(.+)\]", spec):
        return {"type": "array", "items": _type(m.group(1), classes)}
    if m := re.fullmatch(r"dict\(str, (.+)\)", spec):
        return {"type": "object", "additionalProperties": _type(m.group(1), classes)}
    if spec in classes:
        return {"$ref": f"#/$defs/{spec}"}
    if spec in FREE_FORM:
        return {}
    return {"$ref": f"{K8S_DEFS}#/$defs/{_K8S_PATHS.get(spec) or _k8s_names()[spec]}"}


@cache
def _kserve_validator(root: str) -> jsonschema.Draft202012Validator:
    classes = json.loads(KSERVE_TYPES.read_text())["classes"]
    defs = {
        name: {
            "type": "object",
            "properties": {f: _type(t, classes) for f, t in c["fields"].items()},
            "required": c["required"],
            "additionalProperties": False,
        }
        for name, c in classes.items()
    }
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": defs}
    schema["$ref"] = f"#/$defs/{root}"
    registry = Resource.from_contents(_k8s_definitions()) @ Registry()
    return jsonschema.Draft202012Validator(schema, registry=registry)


KSERVE_ROOTS = {
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "V1alpha1ServingRuntime",
    ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): "V1alpha1ClusterServingRuntime",
    ("serving.kserve.io/v1beta1", "InferenceService"): "V1beta1InferenceService",
}


def kserve_errors(doc: dict[str, Any]) -> list[str]:
    """Where ``doc`` breaks KServe's API types (field paths and messages)."""
    root = KSERVE_ROOTS[(doc["apiVersion"], doc["kind"])]
    errors = _kserve_validator(root).iter_errors(doc)
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_every_kserve_field_type_is_known() -> None:
    """Each type a KServe field names is KServe's, Kubernetes', or one of the few known
    free-form ones: a regenerated types file with new types is noticed here."""
    classes = json.loads(KSERVE_TYPES.read_text())["classes"]
    named = {
        re.sub(r"^(list\[|dict\(str, )", "", t).rstrip("])")
        for c in classes.values()
        for t in c["fields"].values()
    }
    unknown = named - set(_PRIMITIVES) - set(classes) - set(_k8s_names()) - set(_K8S_PATHS)
    assert unknown == FREE_FORM


def _kserve_docs() -> dict[str, dict[str, Any]]:
    return {
        f"{p.name}:{d['kind']}": d for p in sorted(DEPLOY.glob("kserve/*.yaml")) for d in _docs(p)
    }


def _runtime() -> dict[str, Any]:
    (runtime,) = [d for d in _kserve_docs().values() if d["kind"] == "ServingRuntime"]
    return runtime


# ---------------------------------------------------------------------- schemas
@pytest.mark.parametrize("name", sorted(_kserve_docs()))
def test_kserve_manifests_match_kserves_api_types(name: str) -> None:
    assert kserve_errors(_kserve_docs()[name]) == []


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda d: d["spec"].update(protocolVersion="v2"), "'protocolVersion' was unexpected"),
        (lambda d: d["spec"]["containers"][0].pop("name"), "'name' is a required property"),
        (lambda d: d["spec"].update(replicas="two"), "'two' is not of type 'integer'"),
        (
            lambda d: d["spec"]["containers"][0]["readinessProbe"]["httpGet"].update(pth="/"),
            "'pth' was unexpected",
        ),
    ],
    ids=["unknown-field", "container-name", "type", "k8s-probe-field"],
)
def test_the_kserve_schema_refuses_broken_runtimes(change: Any, error: str) -> None:
    """The validator can fail: KServe's own fields and the Kubernetes types inside them."""
    doc = copy.deepcopy(_runtime())
    change(doc)
    assert any(error in e for e in kserve_errors(doc)), kserve_errors(doc)


def _k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    """Every Kubernetes object in deploy/k8s (not the Helm values file)."""
    docs = [(p.name, d) for p in sorted(DEPLOY.glob("k8s/*.yaml")) for d in _docs(p)]
    return [(n, d) for n, d in docs if "kind" in d and "apiVersion" in d]


@pytest.mark.parametrize(
    ("name", "doc"), _k8s_docs(), ids=[f"{n}:{d['kind']}" for n, d in _k8s_docs()]
)
def test_k8s_manifests_match_kubernetes_schemas(name: str, doc: dict[str, Any]) -> None:
    if doc["kind"] in UNVALIDATED_CRDS:
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kubernetes_validate_refuses_a_broken_deployment() -> None:
    (doc,) = [d for n, d in _k8s_docs() if (n, d["kind"]) == ("deployment.yaml", "Deployment")]
    doc = copy.deepcopy(doc)
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pth"] = "/"
    with pytest.raises(kubernetes_validate.ValidationError, match="pth"):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


# ---------------------------------------------------------------------- what KServe needs
def test_runtime_serves_the_formats_and_protocols_kserve_routes_to_it() -> None:
    spec = _runtime()["spec"]
    assert {f["name"] for f in spec["supportedModelFormats"]} == {
        "onnx",
        "pytorch",
        "python",
        "ensemble",
        "llm",
    }
    assert spec["protocolVersions"] == ["v2", "grpc-v2"]


def test_runtime_args_are_rtserves_own_flags() -> None:
    """The container's command line parses with rtserve's CLI: the repository KServe mounts,
    every interface, HTTP 8080 and gRPC 8081."""
    (container,) = _runtime()["spec"]["containers"]
    assert container["name"] == "kserve-container" and container["command"] == ["rtserve"]
    args = build_parser().parse_args(container["args"])
    assert args.command == "serve" and args.model_repository == Path("/mnt/models")
    assert (args.host, args.http_port, args.grpc_port) == ("0.0.0.0", 8080, 8081)


def test_runtime_probes_the_v2_health_routes_on_the_http_port() -> None:
    (container,) = _runtime()["spec"]["containers"]
    probes = {k: container[k]["httpGet"] for k in ("readinessProbe", "livenessProbe")}
    assert probes["readinessProbe"] == {"path": "/v2/health/ready", "port": 8080}
    assert probes["livenessProbe"] == {"path": "/v2/health/live", "port": 8080}


def test_inference_services_use_the_runtime_as_it_is_offered() -> None:
    runtime = _runtime()
    formats = {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    services = [d for d in _kserve_docs().values() if d["kind"] == "InferenceService"]
    assert {s["spec"]["predictor"]["model"]["protocolVersion"] for s in services} == {
        "v2",
        "grpc-v2",
    }
    for service in services:
        model = service["spec"]["predictor"]["model"]
        assert model["runtime"] == runtime["metadata"]["name"]
        assert model["modelFormat"]["name"] in formats
        assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
        if model["protocolVersion"] == "grpc-v2":  # KServe routes HTTP/2 to the h2c port
            assert model["ports"] == [{"name": "h2c", "containerPort": 8081, "protocol": "TCP"}]
