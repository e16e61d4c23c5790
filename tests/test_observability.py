"""Traces to a real OTLP/HTTP receiver, JSON and access logs, request-id echo."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tests.conftest import start_server
from tests.models import build_scale

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class OtlpReceiver:
    """An OTLP/HTTP trace receiver on 127.0.0.1: decodes every export it gets."""

    def __init__(self) -> None:
        self.spans: list = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                for rs in request.resource_spans:
                    for ss in rs.scope_spans:
                        receiver.spans.extend(ss.spans)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()


def repo(root: Path) -> Path:
    build_scale(root / "a" / "1" / "model.onnx", 2.0)
    (root / "a" / "config.yaml").write_text("max_batch_size: 4\n")
    return root


def post_infer(base: str, headers: dict[str, str]) -> tuple[int, dict, dict]:
    body = json.dumps(
        {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    ).encode()
    req = urllib.request.Request(f"{base}/v2/models/a/infer", body, headers, method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, dict(r.headers), json.loads(r.read())


def test_a_request_becomes_a_span_tree_that_continues_the_clients_trace(tmp_path: Path) -> None:
    receiver = OtlpReceiver()
    s = start_server(repo(tmp_path / "repo"), tmp_path / "s", "--trace-endpoint", receiver.url)
    try:
        status, _, _ = post_infer(s.base, {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
        assert status == 200
        # a model the server does not have: its name stays out of span names (a bounded set)
        unknown = urllib.request.Request(
            f"{s.base}/v2/models/no-such-{'x' * 20}/infer", b"{}",
            {"traceparent": f"00-{'1' * 32}-{CLIENT_SPAN}-01"}, method="POST",
        )  # fmt: skip
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(unknown, timeout=10)
    finally:
        s.stop()  # flushes the exporter
        receiver.close()
    assert not [span for span in receiver.spans if "no-such" in span.name]
    assert [span for span in receiver.spans if span.name == "infer"]
    receiver.spans[:] = [span for span in receiver.spans if span.trace_id.hex() != "1" * 32]
    by_name = {span.name: span for span in receiver.spans}
    root = by_name["infer a"]
    assert root.trace_id.hex() == TRACE_ID and root.parent_span_id.hex() == CLIENT_SPAN
    for child in ("decode", "queue", "compute", "encode"):
        assert by_name[child].parent_span_id == root.span_id, child
        assert by_name[child].trace_id == root.trace_id
        assert root.start_time_unix_nano <= by_name[child].start_time_unix_nano
        assert by_name[child].end_time_unix_nano <= root.end_time_unix_nano
    batch = by_name["batch a"]
    assert [link.span_id for link in by_name["compute"].links] == [batch.span_id]


def test_sampling_ratio_zero_exports_nothing_for_new_traces(tmp_path: Path) -> None:
    receiver = OtlpReceiver()
    s = start_server(
        repo(tmp_path / "repo"),
        tmp_path / "s",
        "--trace-endpoint",
        receiver.url,
        "--trace-sample-ratio",
        "0",
    )
    try:
        for _ in range(5):
            post_infer(s.base, {})
        # a malformed or all-zero parent is no parent: the ratio still decides (any client
        # could force a full trace of every request before)
        for bad in ("garbage", f"00-{'0' * 32}-{CLIENT_SPAN}-01", "00-xyz"):
            post_infer(s.base, {"traceparent": bad})
    finally:
        s.stop()
        receiver.close()
    assert receiver.spans == []


def test_json_access_log_and_request_id_echo_over_http_and_grpc(tmp_path: Path) -> None:
    s = start_server(
        repo(tmp_path / "repo"), tmp_path / "s", "--log-format", "json", "--access-log"
    )
    try:
        _, headers, _ = post_infer(s.base, {"x-request-id": "req-42"})
        assert headers["x-request-id"] == "req-42"
        client = grpcclient.InferenceServerClient(s.grpc)
        x = grpcclient.InferInput("x", [1, 4], "FP32")
        x.set_data_from_numpy(np.ones((1, 4), np.float32))
        result = client.infer("a", [x], headers={"x-request-id": "req-43"})
        assert result.as_numpy("y").tolist() == [[2.0, 2.0, 2.0, 2.0]]
    finally:
        s.stop()
    lines = [json.loads(line) for line in s.log().splitlines() if line.startswith("{")]
    access = [d for d in lines if d["logger"] == "rtserve.access"]
    assert {d["request_id"] for d in access} >= {"req-42", "req-43"}
    first = next(d for d in access if d["request_id"] == "req-42")
    assert first["model"] == "a" and first["status"] == 200 and first["rows"] == 1
    assert first["total_us"] >= first["compute_us"] >= 0
    assert all(d["level"] in ("info", "warning", "error", "debug") for d in lines)
