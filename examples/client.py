"""Query the example models with Triton's Python clients (HTTP and gRPC).

python examples/client.py --url 127.0.0.1:8000 --grpc-url 127.0.0.1:8001
"""

from __future__ import annotations

import argparse

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from sklearn.datasets import load_digits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", default="127.0.0.1:8000", help="HTTP host:port")
    parser.add_argument("--grpc-url", default="127.0.0.1:8001", help="gRPC host:port")
    args = parser.parse_args()

    digits = load_digits()
    images = (digits.data[:8] / 16.0).astype(np.float32)

    http = httpclient.InferenceServerClient(args.url)
    pixels = httpclient.InferInput("pixels", list(images.shape), "FP32")
    pixels.set_data_from_numpy(images)  # binary tensor extension
    labels = http.infer("digits", [pixels]).as_numpy("label")
    print("HTTP  digits:", labels.tolist(), "true:", digits.target[:8].tolist())

    grpc = grpcclient.InferenceServerClient(args.grpc_url)
    x = grpcclient.InferInput("input", [4, 256], "FP32")
    x.set_data_from_numpy(np.random.default_rng(0).random((4, 256), dtype=np.float32))
    print("gRPC  mlp output shape:", grpc.infer("mlp", [x]).as_numpy("output").shape)


if __name__ == "__main__":
    main()
