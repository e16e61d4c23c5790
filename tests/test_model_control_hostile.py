"""Model control against a hostile client (issue 23, item 6): the load body's size limit,
values echoed cut, what the network may set, ensemble cycles, the --workers journal."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RunningServer, start_server
from tests.models import build_scale, write_config
from tests.test_model_control import infer, post

LOAD = "/v2/repository/models/{}/load"


def _ensemble(step: str) -> dict:
    """An ensemble of one step, ``step`` (input x, output y, as the scale models)."""
    return {
        "backend": "ensemble",
        "max_batch_size": 4,
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}],
        "steps": [{"model": step, "inputs": {"x": "x"}, "outputs": {"y": "y"}}],
    }


def build_repo(root: Path) -> Path:
    for name in ("a", "b"):
        build_scale(root / name / "1" / "model.onnx", 2.0)
        write_config(root, name, {"max_batch_size": 4})
    build_scale(root / "auto" / "1" / "model.onnx", 2.0)  # max_batch_size from the model: 32
    (root / "auto" / "config.yaml").write_text("")
    build_scale(root / "eb" / "1" / "model.onnx", 3.0)
    write_config(root, "eb", {"max_batch_size": 4})
    write_config(root, "ea", _ensemble("eb"))
    write_config(root, "ca", _ensemble("cb"))  # a cycle on disk: ca -> cb -> ca
    write_config(root, "cb", _ensemble("ca"))
    (root / "bigvalue").mkdir()
    (root / "bigvalue" / "config.yaml").write_text(f"max_batch_size: {'x' * 500_000}\n")
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tmp = tmp_path_factory.mktemp("hostile-control")
    repo = build_repo(tmp / "repo")
    s = start_server(repo, tmp / "s", "--model-control-mode", "explicit", "--load-model", "a")
    yield s
    s.stop()


def load(s: RunningServer, model: str, config: object) -> tuple[int, dict]:
    body = json.dumps({"parameters": {"config": config}}).encode()
    return post(s.base, LOAD.format(model), body)


def index(s: RunningServer) -> list[dict]:
    return post(s.base, "/v2/repository/index")[1]


def _peak_rss_kb(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0])


def test_a_load_body_over_a_config_files_limit_is_413_naming_it(server: RunningServer) -> None:
    size = server.log_path.stat().st_size
    peak = _peak_rss_kb(server.proc.pid)
    value = "x" * 45_000_000  # the 45 MB body (once: a 1.58 GB peak, 2.8 s stalled)
    start = time.monotonic()
    status, doc = load(server, "a", {"max_batch_size": value})
    assert time.monotonic() - start < 2.0
    assert status == 413, doc
    assert "1048576 bytes" in doc["error"] and len(doc["error"]) < 300
    assert _peak_rss_kb(server.proc.pid) - peak < 150_000  # the body as received, no copies
    status, doc = load(server, "a", {"max_batch_size": value[:20_000_000]})  # a 20 MB value
    assert status == 413, doc
    assert value[:1000] not in json.dumps(index(server))
    assert server.log_path.stat().st_size - size < 10_000
    assert infer(server.base, "a") == 2.0


def test_values_echoed_are_cut_to_100_characters(server: RunningServer) -> None:
    size = server.log_path.stat().st_size
    value = "y" * 900_000  # under the body limit
    for config in (
        {"max_batch_size": value},
        {"dynamic_batching": {"max_queue_delay_us": [value]}},
        {"response_cache": {"memory": {"ttl_s": value}}},
        {value: 1},
    ):
        status, doc = load(server, "a", config)
        assert status == 400, doc
        assert "y" * 98 in doc["error"] and "y" * 101 not in doc["error"], doc
        assert "characters)" in doc["error"]
    # From a config file too: the answer and the index reason are cut.
    status, doc = post(server.base, LOAD.format("bigvalue"))
    assert status == 400 and "x" * 101 not in doc["error"], doc
    reasons = [r["reason"] for r in index(server) if r["name"] == "bigvalue"]
    assert reasons and len(reasons[0]) < 500 and "x" * 99 in reasons[0], reasons
    assert server.log_path.stat().st_size - size < 20_000


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    sock.settimeout(0.5)
    return sock


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"response_cache": {"redis": {"url": "redis://127.0.0.1:{port}/0"}}}, "response_cache.redis"),
        (
            {"response_cache": {"redis": {"url": "unix:///tmp/x.sock", "hmac_key_env": "RTSERVE_ADMIN_TOKEN"}}},
            "response_cache.redis",
        ),
        ({"backend": "python"}, "backend"),
        ({"labels": {"y": "../../etc/passwd"}}, "labels"),
        ({"python": {"module": "os"}}, "python"),
        ({"onnxruntime": {"execution_providers": ["CPU"]}}, "onnxruntime.execution_providers"),
        ({"inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}]}, "inputs"),
        ({"backend": "ensemble", "steps": [{"model": "a"}]}, "backend"),
        ({"steps": [{"model": "a"}]}, "steps"),
        ({"torch": {"program": "x.pt2"}}, "torch"),
        ({"outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}]}, "outputs"),
    ],
)  # fmt: skip
def test_the_network_may_not_set_urls_env_names_paths_or_code(
    server: RunningServer, config: dict, field: str
) -> None:
    listener = _listener()
    port = listener.getsockname()[1]
    try:
        config = json.loads(json.dumps(config).replace("{port}", str(port)))
        status, doc = load(server, "a", config)
        assert status == 400, doc
        assert doc["error"] == (
            f"load request parameters.config.{field}: not settable over the network; "
            "set it in config.yaml"
        )
        with pytest.raises(TimeoutError):  # the server connected to nothing (no SSRF)
            listener.accept()
    finally:
        listener.close()
    assert infer(server.base, "a") == 2.0


def test_unknown_fields_are_refused_naming_them(server: RunningServer) -> None:
    status, doc = load(server, "a", {"max_batch_size": 2, "max_batch": 8})
    assert status == 400 and "parameters.config.max_batch: unknown field" in doc["error"]
    status, doc = load(server, "a", {"dynamic_batching": {"delay_us": 5}})
    assert (
        status == 400
        and "parameters.config.dynamic_batching.delay_us: unknown field" in (doc["error"])
    )
    status, doc = post(server.base, LOAD.format("a"), b'{"parameters": {}, "config": {}}')
    assert status == 400 and "config: unknown field (expected: parameters)" in doc["error"]
    status, doc = post(server.base, LOAD.format("a"), b'{"parameters": {"file:1/model.onnx": ""}}')
    assert status == 400 and "put them in the model repository" in doc["error"]
    status, doc = post(server.base, LOAD.format("a"), b'{"parameters": {"conifg": "{}"}}')
    assert status == 400 and "parameters.conifg: unknown parameter" in doc["error"]


def test_costs_are_bounded_by_the_machine_and_the_model(server: RunningServer) -> None:
    cpus = len(os.sched_getaffinity(0))
    cases = [
        # The requests: 524,288 warmup rows on a model whose limit is 32, ...
        ({"warmup": {"batch_sizes": [524288]}}, "warmup.batch_sizes", "<= 1024"),
        ({"warmup": {"batch_sizes": [64]}}, "warmup.batch_sizes", "max_batch_size (32)"),
        # ... 1,031 threads, a memory cache of 10^18 bytes.
        ({"instance_count": 1031}, "instance_count", f"<= {cpus}"),
        ({"onnxruntime": {"intra_op_threads": 1031}}, "onnxruntime.intra_op_threads", f"<= {cpus}"),
        (
            {"instance_count": cpus, "onnxruntime": {"intra_op_threads": 2}},
            "instance_count",
            f"= {2 * cpus} threads; expected at most {cpus}",
        ),
        ({"response_cache": {"memory": {"max_bytes": 10**18}}}, "response_cache.memory.max_bytes", "<= 1073741824"),
        ({"warmup": {"iterations": 10_000}}, "warmup.iterations", "<= 100"),
        ({"warmup": {"batch_sizes": [1] * 17}}, "warmup.batch_sizes", "at most 16 integers"),
        ({"max_batch_size": 2048}, "max_batch_size", "<= 1024"),
        ({"onnxruntime": {"inter_op_threads": 1031}}, "onnxruntime.inter_op_threads", f"<= {cpus}"),
        ({"dynamic_batching": {"max_queue_size": 1 << 24}}, "dynamic_batching.max_queue_size", "<= 65536"),
    ]  # fmt: skip
    for config, field, expected in cases:
        status, doc = load(server, "auto", config)
        assert status == 400, (config, doc)
        assert f"load request parameters.config.{field}: " in doc["error"], doc
        assert expected in doc["error"], doc
    # Refused requests load nothing: the model is not in the index as failed.
    assert [r["reason"] for r in index(server) if r["name"] == "auto"] == ["not loaded"]
    # Within the bounds it loads.
    status, doc = load(
        server,
        "auto",
        {
            "warmup": {"batch_sizes": [32]},
            "instance_count": 1,
            "response_cache": {"memory": {"max_bytes": 1 << 20}},
        },
    )
    assert status == 200, doc
    assert infer(server.base, "auto") == 2.0


def test_an_ensemble_cycle_is_refused_at_load_naming_it(server: RunningServer) -> None:
    for model in ("eb", "ea"):
        status, doc = post(server.base, LOAD.format(model))
        assert status == 200, doc
    assert infer(server.base, "ea") == 3.0
    # eb becomes an ensemble that calls ea: ea -> eb -> ea once live.
    root = _repo_of(server)
    write_config(root, "eb", _ensemble("ea"))
    status, doc = post(server.base, LOAD.format("eb"))
    assert status == 400, doc
    assert "cycle: eb -> ea -> eb" in doc["error"], doc
    # Nothing recursed: both models answer, the index answers, the server is ready.
    assert infer(server.base, "ea") == 3.0 and infer(server.base, "eb") == 3.0
    rows = index(server)
    assert {r["state"] for r in rows if r["name"] == "ea"} == {"READY"}
    assert any("cycle: eb -> ea -> eb" in r["reason"] for r in rows if r["name"] == "eb")
    for model in ("ea", "eb"):
        with urllib.request.urlopen(f"{server.base}/v2/models/{model}/ready", timeout=5) as r:
            assert r.status == 200
    # A cycle wholly on disk, neither loaded: refused before anything loads.
    status, doc = post(server.base, LOAD.format("ca"))
    assert status == 400 and "cycle: ca -> cb -> ca" in doc["error"], doc
    assert {r["reason"] for r in index(server) if r["name"] in ("ca", "cb")} == {"not loaded"}


def _repo_of(server: RunningServer) -> Path:
    cmd = Path(f"/proc/{server.proc.pid}/cmdline").read_bytes().split(b"\0")
    return Path(cmd[cmd.index(b"--model-repository") + 1].decode())


def test_workers_journal_only_accepted_loads_and_keep_it_compact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = build_repo(tmp_path / "repo")
    shared = tmp_path / "tmp"
    shared.mkdir()
    monkeypatch.setenv("TMPDIR", str(shared))  # the workers' shared directory goes here
    s = start_server(
        repo, tmp_path / "s", "--workers", "2", "--model-control-mode", "explicit",
        "--load-model", "a", timeout=180,
    )  # fmt: skip
    try:
        assert not list(shared.glob("rtserve-workers-*/model-control.jsonl"))
        # The four invalid 12 MB loads, then invalid small ones: none is journaled.
        for _ in range(4):
            assert load(s, "a", {"max_batch_size": "z" * 12_000_000})[0] == 413
        for _ in range(4):
            assert load(s, "a", {"max_batch_size": "z" * 1000})[0] == 400
        assert not list(shared.glob("rtserve-workers-*/model-control.jsonl"))
        # Forty accepted loads of one model: one entry, the latest.
        for size in range(1, 41):
            status, doc = load(s, "b", {"max_batch_size": 1 + size % 4})
            assert status == 200, doc
        (journal,) = shared.glob("rtserve-workers-*/model-control.jsonl")
        doc = json.loads(journal.read_bytes())
        assert list(doc["models"]) == ["b"] and doc["models"]["b"]["config"] == {
            "max_batch_size": 1
        }
        assert journal.stat().st_size < 300
        # Every worker converges on the latest config (a new connection each time).
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            seen = {_max_batch(s, "b") for _ in range(16)}
            if seen == {1}:
                break
            time.sleep(0.2)
        assert seen == {1}
        # Idle workers do not re-read the journal: a stat every 0.2 s while it is unchanged.
        workers = _children(s.proc.pid)
        before = {pid: _cpu_s(pid) for pid in workers}
        time.sleep(3)
        assert all(_cpu_s(pid) - before[pid] < 0.15 for pid in workers), workers
    finally:
        s.stop()


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _max_batch(s: RunningServer, model: str) -> int:
    with urllib.request.urlopen(f"{s.base}/v2/models/{model}/config", timeout=10) as r:
        return int(json.loads(r.read())["max_batch_size"])


def _ready(s: RunningServer) -> int:
    try:
        with urllib.request.urlopen(f"{s.base}/v2/health/ready", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_bad_values_found_deep_in_a_section_are_refused_before_loading(
    server: RunningServer,
) -> None:
    # A cache value checked only once the model was built leaked the built model, listed it
    # as failed and made the server not ready.
    ready = _ready(server)
    for config, needle in (
        ({"response_cache": {"memory": {"ttl_s": -1}}}, "response_cache.memory.ttl_s"),
        ({"onnxruntime": {"intra_op_threads": 0}}, "onnxruntime.intra_op_threads: expected an integer >= 1"),
    ):  # fmt: skip
        status, doc = load(server, "b", config)
        assert status == 400 and needle in doc["error"], doc
    assert [r["reason"] for r in index(server) if r["name"] == "b"] == ["not loaded"]
    assert _ready(server) == ready


def test_unloading_an_ensembles_step_names_it_and_keeps_the_server_ready(
    server: RunningServer,
) -> None:
    repo = _repo_of(server)
    build_scale(repo / "ustep" / "1" / "model.onnx", 3.0)
    write_config(repo, "ustep", {"max_batch_size": 4})
    write_config(repo, "uens", _ensemble("ustep"))
    for name in ("ustep", "uens"):
        status, doc = post(server.base, LOAD.format(name))
        assert status == 200, doc
    ready = _ready(server)
    assert post(server.base, "/v2/repository/models/ustep/unload")[0] == 200
    try:
        rows = [r for r in index(server) if r["name"] == "uens"]
        assert rows and rows[0]["state"] == "UNAVAILABLE"
        assert rows[0]["reason"] == "step model 'ustep' was unloaded"
        assert _ready(server) == ready  # unloaded on purpose: not a failure
    finally:
        assert post(server.base, LOAD.format("ustep"))[0] == 200
    assert infer(server.base, "uens") == 3.0


# A Python model of the scale models' signature (x -> y, FP32 [4], batched).
PYTHON_XY = {
    "backend": "python",
    "max_batch_size": 4,
    "inputs": [{"name": "x", "datatype": "FP32", "shape": [4]}],
    "outputs": [{"name": "y", "datatype": "FP32", "shape": [4]}],
}

SLOW_LOAD_PY = """
import time

class Model:
    def load(self, context):
        time.sleep(2.0)

    def infer(self, inputs):
        return {"y": inputs["x"] * 2}
"""


def test_a_first_load_in_progress_is_listed_loading_and_keeps_the_server_ready(
    tmp_path: Path,
) -> None:
    import threading

    from tests.models import write_python_model

    repo = build_repo(tmp_path / "repo")
    write_python_model(repo, "slow", PYTHON_XY, SLOW_LOAD_PY)
    s = start_server(repo, tmp_path / "s", "--model-control-mode", "explicit", "--load-model", "a")
    try:
        answer: list[int] = []
        loader = threading.Thread(
            target=lambda: answer.append(post(s.base, LOAD.format("slow"))[0])
        )
        loader.start()
        deadline = time.monotonic() + 10
        while not [r for r in index(s) if r["name"] == "slow" and r["state"] == "LOADING"]:
            assert time.monotonic() < deadline and loader.is_alive(), index(s)
            time.sleep(0.05)
        assert _ready(s) == 200
        loader.join(30)
        assert answer == [200]
        assert infer(s.base, "slow") == 2.0
    finally:
        s.stop()


GATED_LOAD_PY = """
import os, time

class Model:
    def load(self, context):
        gate = os.path.join(os.path.dirname(__file__), "..", "..", "gate")
        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)

    def infer(self, inputs):
        return {"y": inputs["x"] * 2}
"""


def test_a_load_that_hangs_holds_up_only_its_own_model(tmp_path: Path) -> None:
    """While one model's load blocks, other models load, serve and unload; a second load of
    the blocked model waits for it, and an ensemble over it waits too."""
    import threading

    from tests.models import write_python_model

    repo = build_repo(tmp_path / "repo")
    write_python_model(repo, "stuck", PYTHON_XY, GATED_LOAD_PY)
    write_config(repo, "over_stuck", _ensemble("stuck"))
    s = start_server(repo, tmp_path / "s", "--model-control-mode", "explicit", "--load-model", "a")
    answers: dict[str, int] = {}

    def load_in_background(name: str) -> threading.Thread:
        t = threading.Thread(
            target=lambda: answers.update({name: post(s.base, LOAD.format(name))[0]})
        )
        t.start()
        return t

    try:
        stuck = load_in_background("stuck")
        deadline = time.monotonic() + 10
        while not [r for r in index(s) if r["name"] == "stuck" and r["state"] == "LOADING"]:
            assert time.monotonic() < deadline, index(s)
            time.sleep(0.05)
        ensemble = load_in_background("over_stuck")
        started = time.monotonic()
        assert post(s.base, LOAD.format("b"))[0] == 200
        assert infer(s.base, "b") == 2.0
        assert post(s.base, "/v2/repository/models/a/unload")[0] == 200
        assert time.monotonic() - started < 20
        assert stuck.is_alive() and ensemble.is_alive() and not answers
        (repo / "gate").write_text("")
        stuck.join(30)
        ensemble.join(30)
        assert answers == {"stuck": 200, "over_stuck": 200}
        assert infer(s.base, "over_stuck") == 2.0
    finally:
        s.stop()


def test_unloading_unknown_names_keeps_no_state(server: RunningServer) -> None:
    """Each unknown name is a 404 and leaves nothing behind (a lock per name was kept)."""
    import http.client

    before = int(Path(f"/proc/{server.proc.pid}/status").read_text().split("VmRSS:")[1].split()[0])
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    for i in range(3000):
        conn.request("POST", f"/v2/repository/models/{i:05d}{'x' * 4000}/unload")
        response = conn.getresponse()
        response.read()
        assert response.status == 404
    conn.close()
    after = int(Path(f"/proc/{server.proc.pid}/status").read_text().split("VmRSS:")[1].split()[0])
    assert after - before < 8 * 1024, f"RSS grew {after - before} KiB"
