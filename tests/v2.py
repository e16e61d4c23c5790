"""V2 inference requests as the tests send them: a one-input JSON body, one HTTP call, a
tritonclient input."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np

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


def x_input(module: Any, value: float = 1.0) -> Any:
    """Input ``x``, FP32 [1, 4] filled with ``value``, for ``tritonclient.http`` or
    ``tritonclient.grpc`` (``module``)."""
    x = module.InferInput("x", [1, 4], "FP32")
    x.set_data_from_numpy(np.full((1, 4), value, np.float32))
    return x
