"""rtserve.ray on a local Ray instance started here: the V2 routes answer as the plain
server does, two replicas both serve, and a replica Ray kills is replaced while traffic
goes on. A second application on the same instance serves a tiny random-weight language
model: the openai client and Triton's generate routes get the plain server's (greedy)
answers, streamed and not; errors keep OpenAI's shape; a client that disconnects stops
its sequence."""

from __future__ import annotations

import gzip
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import orjson
import pytest
import tritonclient.http as httpclient
import yaml

from tests.cache_fixtures import free_port
from tests.conftest import ROOT, RunningServer, start_server
from tests.llm_models import build_llm
from tests.models import build_identity_all_types, build_mlp, build_scale
from tests.rawhttp import connect
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
    return {a["name"] for a in actors if a["name"].startswith("SERVE_REPLICA::rtserve#")}


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


# ---------------------------------------------------------------------- generative models
LLM = "tiny"
CHAT = [{"role": "user", "content": "Write a short story about a cat."}]
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@dataclass
class LlmApps:
    """The plain server and the Ray application (under ``/llm``) over one llm repository."""

    plain: RunningServer
    ray_base: str
    port: int

    def clients(self) -> list[openai.OpenAI]:
        return [
            openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            for base in (self.ray_base, self.plain.base)
        ]


@pytest.fixture(scope="module")
def llm(ray_app: RayApp, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlmApps]:
    root = tmp_path_factory.mktemp("ray-llm") / "repo"
    build_llm(root, LLM)
    plain = start_server(root, tmp_path_factory.mktemp("plain-llm"))
    try:
        application = rtserve_ray.app(root, num_cpus=0.5, name="rtserve-llm")
        serve.run(application, name="llm", route_prefix="/llm")
        yield LlmApps(plain, f"{ray_app.base}/llm", ray_app.port)
        serve.delete("llm")
    finally:
        plain.stop()


def test_openai_client_answers_as_the_plain_server(llm: LlmApps) -> None:
    """Chat and completions through Ray's ingress, whole and streamed, equal the plain
    server's greedy answers (text, finish reason, usage)."""
    ours, theirs = llm.clients()

    def chat(client: openai.OpenAI) -> tuple[str | None, str, Any]:
        out = client.chat.completions.create(model=LLM, messages=CHAT, **GREEDY)  # type: ignore[call-overload]
        return out.choices[0].message.content, out.choices[0].finish_reason, out.usage

    def chat_stream(client: openai.OpenAI) -> tuple[str, str | None, Any]:
        chunks = list(
            client.chat.completions.create(  # type: ignore[call-overload]
                model=LLM, messages=CHAT, stream=True,
                stream_options={"include_usage": True}, **GREEDY,
            )
        )  # fmt: skip
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, [c for c in chunks if c.choices][-1].choices[0].finish_reason, chunks[-1].usage

    def completion(client: openai.OpenAI, stream: bool) -> str:
        out = client.completions.create(model=LLM, prompt="the cat sat", stream=stream, **GREEDY)  # type: ignore[call-overload]
        return "".join(c.choices[0].text for c in out) if stream else out.choices[0].text

    whole = chat(ours)
    assert whole[0] and whole[1] == "length" and whole[2].completion_tokens == 12
    assert whole == chat(theirs)
    streamed = chat_stream(ours)
    assert streamed == chat_stream(theirs)
    assert streamed[:2] == whole[:2]
    text = completion(ours, False)
    assert text and text == completion(theirs, False) == completion(ours, True)


def test_sse_framing_and_models_through_ray(llm: LlmApps) -> None:
    doc = {"model": LLM, "prompt": "the dog", "stream": True, "max_tokens": 4}
    url = f"{llm.ray_base}/v1/completions"
    with httpx.stream("POST", url, json=doc, headers={"x-request-id": "r-9"}, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers.get_list("x-request-id") == ["r-9"]
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers[REPLICA].startswith("SERVE_REPLICA::llm#")
        body = r.read()
    events = body.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    assert all(
        orjson.loads(e.removeprefix(b"data: "))["object"] == "text_completion" for e in events[:-2]
    )

    ours, theirs = llm.clients()
    assert [m.id for m in ours.models.list().data] == [LLM]
    assert (
        ours.models.retrieve(LLM).max_model_len == theirs.models.retrieve(LLM).max_model_len == 512
    )  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError):
        ours.models.retrieve("no-such-model")


BAD_OPENAI = [
    ("/v1/chat/completions", {"model": LLM, "messages": CHAT, "max_tokens": -1}),
    ("/v1/chat/completions", {"model": LLM, "messages": [{"role": "robot", "content": "hi"}]}),
    ("/v1/chat/completions", {"model": "nope", "messages": CHAT, "stream": True}),
    ("/v1/completions", {"model": LLM, "prompt": "cat " * 600}),
    ("/v1/completions", {"model": LLM, "prompt": "a", "presence_penalty": 5}),
    ("/v1/embeddings", {"model": LLM, "input": "a"}),
]


def test_errors_in_openai_shape_as_the_plain_server(llm: LlmApps) -> None:
    for i, (path, doc) in enumerate(BAD_OPENAI):
        request_id = {"x-request-id": f"bad-{i}"}
        ours = httpx.post(f"{llm.ray_base}{path}", json=doc, headers=request_id, timeout=30)
        theirs = httpx.post(f"{llm.plain.base}{path}", json=doc, timeout=30)
        assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json()), doc
        assert ours.headers.get_list("x-request-id") == [f"bad-{i}"]
        assert set(ours.json()["error"]) == {"message", "type", "param", "code"}
    for content in (b"{nope", b"[1]"):
        ours = httpx.post(f"{llm.ray_base}/v1/chat/completions", content=content, timeout=30)
        assert ours.status_code == 400 and "request body" in ours.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as info:
        llm.clients()[0].chat.completions.create(model="nope", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert info.value.code == "model_not_found"
    # A tensor model's route on the llm application is still the V2 one.
    assert httpx.get(f"{llm.ray_base}/v2/models/{LLM}/ready", timeout=30).status_code == 200


def test_triton_generate_routes_as_the_plain_server(llm: LlmApps) -> None:
    doc = {
        "text_input": "the dog",
        "parameters": {"max_tokens": 7, "temperature": 0, "ignore_eos": True},
    }
    answers = [
        httpx.post(f"{base}/v2/models/{LLM}/generate", json=doc, timeout=30)
        for base in (llm.ray_base, llm.plain.base)
    ]
    assert answers[0].status_code == 200
    assert answers[0].json() == answers[1].json()
    r = httpx.post(
        f"{llm.ray_base}/v2/models/{LLM}/versions/1/generate_stream", json=doc, timeout=30
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    pieces = [orjson.loads(e.removeprefix(b"data: ")) for e in r.content.split(b"\n\n") if e]
    assert len(pieces) >= 2
    assert "".join(p["text_output"] for p in pieces) == answers[0].json()["text_output"]
    bad = httpx.post(f"{llm.ray_base}/v2/models/{LLM}/generate", json={"text_input": 3}, timeout=30)
    assert bad.status_code == 400 and "text_input" in bad.json()["error"]


def _metric(base: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(
            f'{k}="{v}"' in line for k, v in labels.items()
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("stream", [True, False])
def test_client_gone_stops_the_sequence_through_ray(llm: LlmApps, stream: bool) -> None:
    """Closing the connection to Ray's proxy mid-answer aborts the sequence in the replica
    (the abort counter moves, nothing keeps decoding) and the application keeps serving."""
    base = llm.ray_base
    aborted = _metric(base, "rtserve_llm_requests_finished_total", reason="abort")
    generated = _metric(base, "rtserve_llm_generation_tokens_total")
    doc = orjson.dumps(
        {"model": LLM, "prompt": "the cat", "max_tokens": 500, "ignore_eos": True, "stream": stream}
    )
    sock = connect(llm.port)
    sock.sendall(
        b"POST /llm/v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(doc), doc)
    )
    deadline = time.monotonic() + 20
    if stream:
        got = b""
        while got.count(b"data: ") < 3:
            got += sock.recv(65536)
    else:
        while _metric(base, "rtserve_llm_running_sequences") < 1:
            assert time.monotonic() < deadline, "the sequence never started"
            time.sleep(0.02)
    sock.close()
    while _metric(base, "rtserve_llm_requests_finished_total", reason="abort") < aborted + 1:
        assert time.monotonic() < deadline, "the sequence was not aborted"
        time.sleep(0.05)
    assert _metric(base, "rtserve_llm_running_sequences") == 0
    assert _metric(base, "rtserve_llm_generation_tokens_total") - generated < 500
    ok = httpx.post(f"{base}/v1/completions", json={"model": LLM, "prompt": "a"}, timeout=30)
    assert ok.status_code == 200


def test_an_unhealthy_replica_names_its_failed_models(tmp_path: Path) -> None:
    """Ray's deploy error repeats the health check's: it names the model and why."""
    import asyncio

    from rtserve import Engine
    from rtserve.ray import RTServeDeployment

    build_scale(tmp_path / "repo" / "ok" / "1" / "model.onnx", 2.0)
    (tmp_path / "repo" / "broken" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "broken" / "1" / "model.onnx").write_bytes(b"not a model")

    async def run() -> str:
        replica = RTServeDeployment.__new__(RTServeDeployment)
        replica.engine = Engine.from_repository(tmp_path / "repo")
        await replica.engine.start()
        try:
            with pytest.raises(RuntimeError) as info:
                replica.check_health()
            return str(info.value)
        finally:
            await replica.engine.stop()

    message = asyncio.run(run())
    assert message.startswith("rtserve engine is not ready: broken (") and "ok (" not in message
    assert "could not load the model" in message
