"""V2 inference requests as the tests send them: a one-input JSON body, one HTTP call."""

from __future__ import annotations

from typing import Any

import httpx

from tests.conftest import RunningServer


def infer_body(
    name: str, data: list[Any], shape: list[int], datatype: str = "FP32", **params: object
) -> dict[str, Any]:
    """A V2 JSON body with one input tensor; keyword arguments become its ``parameters``."""
    body: dict[str, Any] = {
        "inputs": [{"name": name, "shape": shape, "datatype": datatype, "data": data}]
    }
    if params:
        body["parameters"] = params
    return body


def http_infer(
    server: RunningServer, model: str, body: dict[str, Any], timeout: float = 10.0
) -> httpx.Response:
    return httpx.post(f"{server.base}/v2/models/{model}/infer", json=body, timeout=timeout)
