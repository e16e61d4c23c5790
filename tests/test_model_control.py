"""Model control: load, unload, zero-downtime swaps, poll mode, and one view of N workers."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import start_server
from tests.models import build_scale, write_python_model


def scale_repo(root: Path, factors: dict[str, float]) -> Path:
    """Models named by ``factors``: y = x * factor, version 1."""
    for name, factor in factors.items():
        build_scale(root / name / "1" / "model.onnx", factor)
        (root / name / "config.yaml").write_text(
            "max_batch_size: 4\nversion_policy: latest\ndynamic_batching: {max_queue_delay_us: 100}\n"
        )
    return root


def infer(base: str, model: str) -> float:
    body = json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 1, 1, 1]}]}
    ).encode()
    req = urllib.request.Request(f"{base}/v2/models/{model}/infer", body, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return float(json.loads(r.read())["outputs"][0]["data"][0])


def post(base: str, path: str, body: bytes = b"") -> tuple[int, dict]:
    req = urllib.request.Request(f"{base}{path}", body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_explicit_mode_loads_and_unloads_with_tritonclient_http_and_grpc(tmp_path: Path) -> None:
    repo = scale_repo(tmp_path / "repo", {"a": 2.0, "b": 3.0})
    s = start_server(repo, tmp_path / "s", "--model-control-mode", "explicit", "--load-model", "a")
    try:
        http = httpclient.InferenceServerClient(s.http)
        assert http.is_model_ready("a")
        with pytest.raises(InferenceServerException):
            http.get_model_metadata("b")
        http.load_model("b")
        assert http.is_model_ready("b") and infer(s.base, "b") == 3.0
        http.unload_model("b")
        with pytest.raises(InferenceServerException, match="unknown model 'b'"):
            http.get_model_metadata("b")
        # Over gRPC too.
        grpc = grpcclient.InferenceServerClient(s.grpc)
        grpc.load_model("b")
        assert grpc.is_model_ready("b") and infer(s.base, "b") == 3.0
        grpc.unload_model("b")
        # Listed as unloaded, as Triton lists it (the version is no longer known).
        rows = [m for m in grpc.get_model_repository_index().models if m.name == "b"]
        assert [(m.version, m.state, m.reason) for m in rows] == [("", "UNAVAILABLE", "unloaded")]
        rows = [m for m in http.get_model_repository_index() if m["name"] == "b"]
        assert [(m["state"], m["reason"]) for m in rows] == [("UNAVAILABLE", "unloaded")]
        http.load_model("b")  # loaded again: listed as ready, no longer as unloaded
        rows = [m for m in http.get_model_repository_index() if m["name"] == "b"]
        assert [m["state"] for m in rows] == ["READY"], rows
        # An unknown model: a clear error, and the server keeps serving.
        with pytest.raises(InferenceServerException, match="no such model in the repository"):
            http.load_model("nope")
        assert infer(s.base, "a") == 2.0
    finally:
        s.stop()


def test_load_with_a_config_override_in_the_body(tmp_path: Path) -> None:
    repo = scale_repo(tmp_path / "repo", {"a": 2.0})
    s = start_server(repo, tmp_path / "s", "--model-control-mode", "explicit")
    try:
        http = httpclient.InferenceServerClient(s.http)
        http.load_model("a", config=json.dumps({"max_batch_size": 2}))
        assert http.get_model_config("a")["max_batch_size"] == 2
        status, doc = post(s.base, "/v2/repository/models/a/load", b'{"parameters": {"config": 5}}')
        assert status == 400 and "parameters.config" in doc["error"]
    finally:
        s.stop()


def test_load_and_unload_are_refused_unless_explicit(tmp_path: Path) -> None:
    repo = scale_repo(tmp_path / "repo", {"a": 2.0})
    s = start_server(repo, tmp_path / "s")
    try:
        status, doc = post(s.base, "/v2/repository/models/a/unload")
        assert status == 400 and "--model-control-mode explicit" in doc["error"]
        assert infer(s.base, "a") == 2.0
    finally:
        s.stop()


def _load_loop(base: str, model: str, stop: threading.Event, answers: list, errors: list) -> None:
    while not stop.is_set():
        try:
            answers.append((time.monotonic(), infer(base, model)))
        except Exception as exc:  # every failure is recorded and fails the test
            errors.append(repr(exc))
        time.sleep(0.005)


@contextmanager
def _under_load(
    base: str, model: str, clients: int
) -> Iterator[tuple[list[tuple[float, float]], list[str]]]:
    """``clients`` threads inferring on ``model`` until the block ends (they are joined
    then); yields the (time, answer) pairs and the errors they collect."""
    stop = threading.Event()
    answers: list[tuple[float, float]] = []
    errors: list[str] = []
    threads = [
        threading.Thread(target=_load_loop, args=(base, model, stop, answers, errors))
        for _ in range(clients)
    ]
    for t in threads:
        t.start()
    try:
        yield answers, errors
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_a_new_version_swaps_in_under_load_with_no_failed_request(tmp_path: Path) -> None:
    repo = scale_repo(tmp_path / "repo", {"a": 2.0})
    s = start_server(repo, tmp_path / "s", "--model-control-mode", "explicit", "--load-model", "a")
    try:
        with _under_load(s.base, "a", 2) as (answers, errors):
            time.sleep(1.0)
            build_scale(repo / "a" / "2" / "model.onnx", 7.0)
            status, doc = post(s.base, "/v2/repository/models/a/load")
            assert status == 200, doc
            swapped = time.monotonic()
            time.sleep(1.0)
            # A broken version 3: the load fails, version 2 keeps serving, the index says why.
            (repo / "a" / "3").mkdir()
            (repo / "a" / "3" / "model.onnx").write_bytes(b"not a model")
            status, doc = post(s.base, "/v2/repository/models/a/load")
            assert status == 400 and "failed to load 'a'" in doc["error"]
            time.sleep(0.5)
        assert errors == []
        assert len(answers) > 100
        assert {v for t, v in answers if t > swapped} == {7.0}
        assert infer(s.base, "a") == 7.0
        _, index = post(s.base, "/v2/repository/index")
        reasons = [row["reason"] for row in index if row["name"] == "a" and row["reason"]]
        assert reasons and "3" in reasons[0]
    finally:
        s.stop()


def test_poll_mode_picks_up_new_versions_and_removed_models(tmp_path: Path) -> None:
    repo = scale_repo(tmp_path / "repo", {"a": 2.0, "b": 3.0})
    s = start_server(
        repo, tmp_path / "s", "--model-control-mode", "poll", "--repository-poll-secs", "0.2"
    )
    try:
        assert infer(s.base, "a") == 2.0
        build_scale(repo / "a" / "2" / "model.onnx", 5.0)
        deadline = time.monotonic() + 20
        while infer(s.base, "a") != 5.0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert infer(s.base, "a") == 5.0
        import shutil

        shutil.rmtree(repo / "b")
        while time.monotonic() < deadline:
            _, index = post(s.base, "/v2/repository/index")
            if "b" not in {row["name"] for row in index}:
                break
            time.sleep(0.1)
        assert "b" not in {row["name"] for row in post(s.base, "/v2/repository/index")[1]}
    finally:
        s.stop()


def _requests_total(text: str, model: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("rtserve_requests_total{") and f'model="{model}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_workers_give_one_monotonic_view_of_metrics_and_statistics(tmp_path: Path) -> None:
    repo = scale_repo(tmp_path / "repo", {"a": 2.0})
    s = start_server(repo, tmp_path / "s", "--workers", "4", timeout=180)
    try:
        with _under_load(s.base, "a", 3) as (answers, errors):
            seen = []
            for _ in range(20):
                with urllib.request.urlopen(f"{s.base}/metrics", timeout=10) as r:
                    seen.append(_requests_total(r.read().decode(), "a"))
                time.sleep(0.05)
        assert errors == []
        assert all(b >= a for a, b in zip(seen, seen[1:], strict=False)), seen
        time.sleep(1.0)  # every worker has published its last counts
        with urllib.request.urlopen(f"{s.base}/metrics", timeout=10) as r:
            assert _requests_total(r.read().decode(), "a") == len(answers)
        with urllib.request.urlopen(f"{s.base}/v2/models/a/stats", timeout=10) as r:
            stats = json.loads(r.read())["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == len(answers)
    finally:
        s.stop()


def test_every_worker_converges_on_explicit_loads_and_unloads(tmp_path: Path) -> None:
    repo = scale_repo(tmp_path / "repo", {"a": 2.0, "b": 3.0})
    s = start_server(
        repo, tmp_path / "s", "--workers", "3", "--model-control-mode", "explicit",
        "--load-model", "a", timeout=180,
    )  # fmt: skip

    def answers(model: str) -> list[float | None]:
        out: list[float | None] = []
        for _ in range(24):  # a new connection each time: any worker may take it
            try:
                out.append(infer(s.base, model))
            except urllib.error.HTTPError:
                out.append(None)
        return out

    try:
        status, doc = post(s.base, "/v2/repository/models/b/load")
        assert status == 200, doc
        deadline = time.monotonic() + 30
        while answers("b") != [3.0] * 24 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert answers("b") == [3.0] * 24
        status, doc = post(s.base, "/v2/repository/models/b/unload")
        assert status == 200, doc
        while answers("b") != [None] * 24 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert answers("b") == [None] * 24
        assert answers("a") == [2.0] * 24
    finally:
        s.stop()


# ---------------------------------------------------------------------- the load body (item 10)
PY_MODEL = """
class Model:
    def infer(self, inputs):
        return {"y": inputs["x"] * 5}
"""


def python_model(root: Path, name: str) -> None:
    """A Python backend model (y = x * 5): its config.yaml holds what a partial load config
    must not lose (the backend, the tensors, the batching window)."""
    config = (
        "backend: python\nmax_batch_size: 4\ndynamic_batching: {max_queue_delay_us: 700}\n"
        "inputs: [{name: x, datatype: FP32, shape: [4]}]\n"
        "outputs: [{name: y, datatype: FP32, shape: [4]}]\n"
    )
    write_python_model(root, name, config, PY_MODEL)


def test_a_partial_config_is_merged_over_config_yaml(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    python_model(repo, "py")
    s = start_server(repo, tmp_path / "s", "--model-control-mode", "explicit")
    try:
        http = httpclient.InferenceServerClient(s.http)
        http.load_model("py", config=json.dumps({"max_batch_size": 8}))
        config = http.get_model_config("py")
        assert (config["max_batch_size"], config["backend"]) == (8, "python")
        assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 700
        assert infer(s.base, "py") == 5.0
        grpc = grpcclient.InferenceServerClient(s.grpc)
        grpc.load_model("py", config=json.dumps({"dynamic_batching": {"max_queue_delay_us": 9}}))
        config = grpc.get_model_config("py", as_json=True)["config"]
        assert (config["max_batch_size"], config["backend"]) == (4, "python")
        assert config["dynamic_batching"]["max_queue_delay_microseconds"] == "9"
        assert infer(s.base, "py") == 5.0
    finally:
        s.stop()


def test_body_errors_name_the_request_and_unknown_fields_are_refused(tmp_path: Path) -> None:
    repo = scale_repo(tmp_path / "repo", {"a": 2.0})
    s = start_server(repo, tmp_path / "s", "--model-control-mode", "explicit", "--load-model", "a")
    try:
        clients = (
            httpclient.InferenceServerClient(s.http),
            grpcclient.InferenceServerClient(s.grpc),
        )
        for client in clients:
            with pytest.raises(InferenceServerException) as err:
                client.load_model("a", config=json.dumps({"max_batch_size": -1}))
            message = str(err.value)
            assert "load request parameters.config.max_batch_size: expected an integer" in message
            assert "config.yaml" not in message
            # One the allow-list passes but the config parser refuses: named the same way.
            with pytest.raises(InferenceServerException) as err:
                client.load_model("a", config=json.dumps({"warmup": {"batch_sizes": [8]}}))
            assert "load request parameters.config.warmup.batch_sizes: expected sizes <= " in (
                str(err.value)
            )
            assert "config.yaml" not in str(err.value)
            with pytest.raises(InferenceServerException, match=r"config\.bogus: unknown field"):
                client.load_model("a", config=json.dumps({"max_batch_size": 2, "bogus": 1}))
            with pytest.raises(InferenceServerException, match="not settable over the network"):
                client.load_model("a", config=json.dumps({"backend": "python"}))
            big = json.dumps({"max_batch_size": 2, "name": "a" * 1_100_000})  # over 1 MiB
            with pytest.raises(InferenceServerException, match="limit of 1048576 bytes"):
                client.load_model("a", config=big)
        # Refused requests changed nothing: the file's config still serves.
        assert infer(s.base, "a") == 2.0
        assert clients[0].get_model_config("a")["max_batch_size"] == 4
        rows = [r for r in clients[0].get_model_repository_index() if r["name"] == "a"]
        assert [(r["state"], r["reason"]) for r in rows] == [("READY", "")]
    finally:
        s.stop()


def ensemble_repo(root: Path) -> Path:
    """double (x2), triple (x3) and chain: an ensemble of double then triple."""
    scale_repo(root, {"double": 2.0, "triple": 3.0})
    (root / "chain" / "1").mkdir(parents=True)
    step = "{{model: {}, inputs: {{x: {}}}, outputs: {{y: {}}}}}"
    (root / "chain" / "config.yaml").write_text(
        "backend: ensemble\nmax_batch_size: 4\n"
        "inputs: [{name: x, datatype: FP32, shape: [4]}]\n"
        "outputs: [{name: y, datatype: FP32, shape: [4]}]\n"
        f"steps: [{step.format('double', 'x', 'x2')}, {step.format('triple', 'x2', 'y')}]\n"
    )
    return root


def test_loading_an_ensemble_loads_its_steps(tmp_path: Path) -> None:
    repo = ensemble_repo(tmp_path / "repo")
    s = start_server(repo, tmp_path / "s", "--model-control-mode", "explicit")
    try:
        http = httpclient.InferenceServerClient(s.http)
        http.load_model("chain")
        assert http.is_model_ready("double") and http.is_model_ready("triple")
        assert infer(s.base, "chain") == 6.0
        for name in ("chain", "double", "triple"):
            http.unload_model(name)
        grpc = grpcclient.InferenceServerClient(s.grpc)
        grpc.load_model("chain")
        assert grpc.is_model_ready("chain") and grpc.is_model_ready("triple")
        assert infer(s.base, "chain") == 6.0
    finally:
        s.stop()
    # At start too: --load-model chain loads its steps.
    s = start_server(
        repo, tmp_path / "s2", "--model-control-mode", "explicit", "--load-model", "chain"
    )
    try:
        assert infer(s.base, "chain") == 6.0 and infer(s.base, "double") == 2.0
    finally:
        s.stop()


def test_explicit_mode_index_lists_every_model_in_the_repository(tmp_path: Path) -> None:
    repo = scale_repo(tmp_path / "repo", {"a": 2.0, "b": 3.0})
    s = start_server(repo, tmp_path / "s", "--model-control-mode", "explicit", "--load-model", "a")
    try:
        http = httpclient.InferenceServerClient(s.http)
        rows = {r["name"]: (r["state"], r["reason"]) for r in http.get_model_repository_index()}
        assert rows == {"a": ("READY", ""), "b": ("UNAVAILABLE", "not loaded")}
        grpc = grpcclient.InferenceServerClient(s.grpc)
        rows = {m.name: (m.state, m.reason) for m in grpc.get_model_repository_index().models}
        assert rows == {"a": ("READY", ""), "b": ("UNAVAILABLE", "not loaded")}
        http.load_model("b")
        states = {r["name"]: r["state"] for r in http.get_model_repository_index()}
        assert states == {"a": "READY", "b": "READY"}
    finally:
        s.stop()


def test_a_load_with_a_triton_version_policy_serves_those_versions(tmp_path: Path) -> None:
    """tritonclient's load_model(config=...) with version_policy as Triton writes it."""
    import json

    repo = scale_repo(tmp_path / "repo", {"a": 2.0})
    for v, factor in ((2, 3.0), (3, 4.0)):
        build_scale(repo / "a" / str(v) / "model.onnx", factor)
    s = start_server(repo, tmp_path / "s", "--model-control-mode", "explicit", "--load-model", "a")
    try:
        client = httpclient.InferenceServerClient(s.http)
        for policy, ready in (
            ({"latest": {"num_versions": 2}}, {"2", "3"}),
            ({"specific": {"versions": [1]}}, {"1"}),
            ({"all": {}}, {"1", "2", "3"}),
        ):
            client.load_model("a", config=json.dumps({"version_policy": policy}))
            served = {v for v in ("1", "2", "3") if client.is_model_ready("a", v)}
            assert served == ready, policy
        with pytest.raises(InferenceServerException) as info:
            client.load_model("a", config=json.dumps({"version_policy": {"specific": []}}))
        assert "version_policy: expected specific: a non-empty list" in info.value.message()
    finally:
        s.stop()
