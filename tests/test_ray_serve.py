"""rtserve.ray on a local Ray instance started here: the V2 routes answer as the plain
server does, two replicas both serve, and a replica Ray kills is replaced while traffic
goes on."""

from __future__ import annotations

import gzip
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
import yaml

from tests.cache_fixtures import free_port
from tests.conftest import ROOT, RunningServer, start_server
from tests.models import build_identity_all_types, build_mlp, build_scale
from tests.v2 import infer_body

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

import rtserve.ray as rtserve_ray  # noqa: E402  (after the skip: it needs ray)
from rtserve.errors import ConfigError  # noqa: E402

REPLICA = "x-rtserve-replica"
MLP_ROW = [round(0.01 * i, 2) for i in range(256)]


@dataclass
class RayApp:
    port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ray") / "repo"
    build_mlp(root / "mlp" / "1" / "model.onnx")
    (root / "mlp" / "config.yaml").write_text(
        "max_batch_size: 32\ndynamic_batching: {max_queue_delay_us: 500}\n"
    )
    build_scale(root / "scale" / "1" / "model.onnx", 1.0)
    build_scale(root / "scale" / "2" / "model.onnx", 2.0)
    (root / "scale" / "config.yaml").write_text("max_batch_size: 4\n")
    build_identity_all_types(root / "dtypes" / "1" / "model.onnx")
    (root / "dtypes" / "config.yaml").write_text("max_batch_size: 8\n")
    return root


@pytest.fixture(scope="module")
def plain(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    s = start_server(repo, tmp_path_factory.mktemp("plain"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ray_app(repo: Path) -> Iterator[RayApp]:
    """Ray with 2 CPUs and no dashboard; the Serve proxy on 127.0.0.1; two replicas."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_worker_niceness", "0")  # Ray's workers otherwise run at nice 15
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            # As `serve run rtserve.ray:build repository=... num_replicas=2` passes them.
            args = {"repository": str(repo), "num_replicas": "2", "num_cpus": "0.5"}
            serve.run(rtserve_ray.build(args), name="rtserve", route_prefix="/")
            yield RayApp(port)
        finally:
            serve.shutdown()
            ray.shutdown()


def _answer(r: httpx.Response) -> tuple[int, str | None, bytes]:
    return r.status_code, r.headers.get("content-type"), r.content


def _get(base: str, path: str) -> tuple[int, str | None, bytes]:
    return _answer(httpx.get(base + path, timeout=30))


def _post(base: str, path: str, body: bytes) -> tuple[int, str | None, bytes]:
    return _answer(httpx.post(base + path, content=body, timeout=30))


GETS = [
    "/v2",
    "/v2/health/live",
    "/v2/health/ready",
    "/v2/models/mlp",
    "/v2/models/mlp/ready",
    "/v2/models/mlp/config",
    "/v2/models/scale/versions/1",
    "/v2/models/dtypes/config",
    "/v2/models/nope",
    "/v2/nothing",
]
POSTS = [
    ("/v2/models/mlp/infer", httpx.Request("POST", "/", json=infer_body("input", MLP_ROW, [1, 256]))),
    ("/v2/models/scale/infer", httpx.Request("POST", "/", json=infer_body("x", [1, 2, 3, 4], [1, 4]))),
    (
        "/v2/models/scale/versions/2/infer",
        httpx.Request("POST", "/", json=infer_body("x", [1, 2, 3, 4], [1, 4])),
    ),
    (
        "/v2/models/dtypes/infer",
        httpx.Request(
            "POST", "/", json={
                "inputs": [
                    {"name": "in_BYTES", "shape": [1, 3], "datatype": "BYTES", "data": ["a", "bc", ""]},
                    {"name": "in_INT64", "shape": [1, 3], "datatype": "INT64", "data": [1, -2, 3]},
                ],
                "outputs": [{"name": "out_BYTES"}, {"name": "out_INT64"}],
            },
        ),
    ),  # fmt: skip
    ("/v2/models/mlp/infer", httpx.Request("POST", "/", content=b"{not json")),
    ("/v2/models/mlp/infer", httpx.Request("POST", "/", json=infer_body("input", [1.0], [1, 3]))),
    ("/v2/models/nope/infer", httpx.Request("POST", "/", json=infer_body("x", [1], [1, 1]))),
    ("/v2/models/scale/versions/9/infer", httpx.Request("POST", "/", json=infer_body("x", [1], [1, 4]))),
]  # fmt: skip


def test_routes_answer_as_the_plain_server(ray_app: RayApp, plain: RunningServer) -> None:
    for path in GETS:
        assert _get(ray_app.base, path) == _get(plain.base, path), path
    for path, request in POSTS:
        body = request.read()
        ours, theirs = _post(ray_app.base, path, body), _post(plain.base, path, body)
        assert ours == theirs, path
    statuses = {_post(plain.base, p, r.read())[0] for p, r in POSTS}
    assert statuses == {200, 400, 404}


def test_compressed_and_oversized_bodies_as_the_plain_server(
    ray_app: RayApp, plain: RunningServer
) -> None:
    body = gzip.compress(orjson.dumps(infer_body("input", MLP_ROW, [1, 256])))
    for encoding in ("gzip", "br"):
        headers = {"content-encoding": encoding}
        ours, theirs = (
            httpx.post(f"{base}/v2/models/mlp/infer", content=body, headers=headers, timeout=30)
            for base in (ray_app.base, plain.base)
        )
        assert _answer(ours) == _answer(theirs), encoding
    assert ours.status_code == 400 and b"br" in ours.content
    big = httpx.post(f"{ray_app.base}/v2/models/mlp/infer", content=b" " * (65 << 20), timeout=60)
    assert big.status_code == 413 and b"max_request_bytes" in big.content


def test_binary_tensors_through_tritonclient(ray_app: RayApp, plain: RunningServer) -> None:
    x = np.random.default_rng(1).random((3, 256), dtype=np.float32)

    def infer(url: str) -> np.ndarray:
        client = httpclient.InferenceServerClient(url)
        i = httpclient.InferInput("input", [3, 256], "FP32")
        i.set_data_from_numpy(x, binary_data=True)
        out = httpclient.InferRequestedOutput("output", binary_data=True)
        result = client.infer("mlp", [i], outputs=[out], request_id="r-7")
        assert result.get_response()["id"] == "r-7"
        return result.as_numpy("output")

    ours = infer(f"127.0.0.1:{ray_app.port}")
    assert ours.shape == (3, 10)
    np.testing.assert_array_equal(ours, infer(plain.http))


def test_model_control_is_refused_with_a_reason(ray_app: RayApp) -> None:
    status, _, body = _post(ray_app.base, "/v2/repository/models/mlp/unload", b"")
    assert status == 501
    assert b"redeploy" in body
    assert _get(ray_app.base, "/v2/models/mlp/ready")[0] == 200


def _replica_actors() -> set[str]:
    """The names of the replica actors Ray runs now (what the replica header carries)."""
    actors = ray.util.list_named_actors(all_namespaces=True)
    return {a["name"] for a in actors if a["name"].startswith("SERVE_REPLICA::")}


def _serving(base: str, want: set[str], limit_s: float = 20.0) -> tuple[set[str], int]:
    """Send rounds of 32 requests, 8 at a time, until every replica in ``want`` answered
    one (Ray's router spreads requests only under concurrency); returns who answered and
    how many requests failed."""
    body = infer_body("x", [1, 2, 3, 4], [1, 4])

    def one(_: int) -> str | None:
        try:
            r = httpx.post(f"{base}/v2/models/scale/infer", json=body, timeout=10)
        except httpx.HTTPError:
            return None
        return r.headers.get(REPLICA) if r.status_code == 200 else None

    seen: set[str] = set()
    failed = 0
    deadline = time.monotonic() + limit_s
    with ThreadPoolExecutor(8) as pool:
        while not want <= seen and time.monotonic() < deadline:
            answers = list(pool.map(one, range(32)))
            failed += answers.count(None)
            seen.update(a for a in answers if a is not None)
    return seen, failed


def test_two_replicas_both_serve(ray_app: RayApp) -> None:
    replicas = _replica_actors()
    assert len(replicas) == 2
    assert _serving(ray_app.base, replicas) == (replicas, 0)


def test_killed_replica_is_replaced_and_traffic_continues(ray_app: RayApp) -> None:
    before = _replica_actors()
    victim = sorted(before)[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    killed = time.monotonic()
    body = infer_body("x", [1, 2, 3, 4], [1, 4])
    failed: list[float] = []
    answered = 0
    now = before
    with httpx.Client(base_url=ray_app.base) as client:
        while time.monotonic() - killed < 45:
            r = client.post("/v2/models/scale/infer", json=body, timeout=10)
            answered += r.status_code == 200
            if r.status_code != 200:
                failed.append(time.monotonic() - killed)
            now = _replica_actors()
            if len(now) == 2 and victim not in now:
                break
            time.sleep(0.05)
    replaced_after = time.monotonic() - killed
    assert len(now) == 2 and victim not in now, f"not replaced within 45 s: {now}"
    # Traffic went on through the survivor: failures, if any, only right after the kill.
    assert len(failed) <= 3 and not [t for t in failed if t > 5.0], failed
    assert answered > 10
    # The new replica takes its share, with no failures.
    assert _serving(ray_app.base, now) == (now, 0), replaced_after


def test_serve_config_example_builds(repo: Path) -> None:
    """deploy/ray/serve.yaml passes Ray's own schema, and its args build the application."""
    from importlib import import_module

    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load((ROOT / "deploy" / "ray" / "serve.yaml").read_text())
    config = ServeDeploySchema.parse_obj(doc)
    assert config.http_options.host == "127.0.0.1"
    spec = config.applications[0]
    module, _, attr = spec.import_path.partition(":")
    builder = getattr(import_module(module), attr)
    deployment = builder({**spec.args, "repository": str(repo)})._bound_deployment
    autoscaling = deployment._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 4)
    assert autoscaling.target_ongoing_requests == 16
    assert deployment.max_ongoing_requests == 64
    assert deployment.ray_actor_options == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert deployment.logging_config["enable_access_log"] is False


def test_builder_arguments_are_checked(repo: Path) -> None:
    with pytest.raises(ConfigError, match="unknown argument 'replicas'"):
        rtserve_ray.build({"repository": str(repo), "replicas": "2"})
    with pytest.raises(ConfigError, match="num_replicas: expected int, got 'two'"):
        rtserve_ray.build({"repository": str(repo), "num_replicas": "two"})
    with pytest.raises(ConfigError, match="'repository' is required"):
        rtserve_ray.build({"num_replicas": "2"})
    deployment = rtserve_ray.build({"repository": str(repo), "access_log": "true"})
    assert deployment._bound_deployment.logging_config["enable_access_log"] is True
