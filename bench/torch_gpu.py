"""The torch runtime alone vs plain PyTorch on the same GPU (numbers for docs/gpu.md).

    python bench/torch_gpu.py [--quick] [--out results.json]

Models with random weights: a MiniLM-size BERT (transformers' BertConfig: 6 layers, 384
hidden, 12 heads, seq 32) and torchvision's ResNet-50, both FP16. Each is measured three
ways at each batch size, median of alternating rounds of repeated runs:
  plain-gpu   plain PyTorch, inputs already on the GPU, outputs left there (CUDA events)
  plain-host  plain PyTorch from numpy in to numpy out (H2D + forward + D2H, wall clock)
  runtime     rtserve's TorchModel.run(instance, numpy feeds) (wall clock)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from rtserve.config import parse_model_config  # noqa: E402
from rtserve.runtime.torch import load  # noqa: E402

BERT_PY = """
import torch
from transformers import BertConfig, BertModel


class Embedder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        cfg = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                         intermediate_size=1536, vocab_size=30522)
        cfg._attn_implementation = "sdpa"
        self.bert = BertModel(cfg, add_pooling_layer=False)

    def forward(self, input_ids, attention_mask):
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        e = (h * m).sum(1) / m.sum(1).clamp(min=1)
        return torch.nn.functional.normalize(e, dim=-1)


def build():
    return Embedder()
"""

RESNET_PY = '''
import torch
import torchvision


class Classifier(torch.nn.Module):
    """uint8 NCHW images in, logits out: normalisation runs on the GPU."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torchvision.models.resnet50(weights=None)
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255)
        self.register_buffer("std", torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255)

    def forward(self, images):
        x = (images.to(self.mean.dtype) - self.mean) / self.std
        return self.net(x.contiguous(memory_format=torch.channels_last))


def build():
    return Classifier()
'''

MODELS: dict[str, dict[str, Any]] = {
    "minilm": {
        "source": BERT_PY,
        "inputs": [
            {"name": "input_ids", "datatype": "INT64", "shape": [32]},
            {"name": "attention_mask", "datatype": "INT64", "shape": [32]},
        ],
        "outputs": [{"name": "embedding", "datatype": "FP32", "shape": [384]}],
        "batches": [1, 32, 256],
    },
    "resnet50": {
        "source": RESNET_PY,
        "inputs": [{"name": "images", "datatype": "UINT8", "shape": [3, 224, 224]}],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [1000]}],
        "batches": [1, 32, 128],
        "channels_last": True,
    },
}


def feeds_for(name: str, rows: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(rows)
    if name == "minilm":
        ids = rng.integers(1000, 30000, size=(rows, 32)).astype(np.int64)
        return {"input_ids": ids, "attention_mask": np.ones((rows, 32), np.int64)}
    return {"images": rng.integers(0, 256, size=(rows, 3, 224, 224)).astype(np.uint8)}


def median_ms(fn: Callable[[], Any], iters: int, sync: bool = True) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def gpu_ms(fn: Callable[[], Any], iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def plain(name: str, module: torch.nn.Module, batches: list[int], iters: int) -> list[dict]:
    rows_out = []
    for rows in batches:
        feeds = feeds_for(name, rows)
        dev = [torch.from_numpy(a).cuda() for a in feeds.values()]
        with torch.inference_mode():

            def on_gpu(dev: list[torch.Tensor] = dev) -> Any:
                return module(*dev)

            def from_host(feeds: dict[str, np.ndarray] = feeds) -> Any:
                args = [torch.from_numpy(a).cuda(non_blocking=False) for a in feeds.values()]
                return module(*args).float().cpu().numpy()

            g = gpu_ms(on_gpu, iters)
            h = median_ms(from_host, iters)
        rows_out.append({"batch": rows, "plain_gpu_ms": g, "plain_host_ms": h})
    return rows_out


def runtime_rows(rt: Any, name: str, batches: list[int], iters: int) -> list[float]:
    out = []
    for rows in batches:
        feeds = feeds_for(name, rows)
        out.append(median_ms(lambda f=feeds: rt.run(0, f), iters, sync=False))
    return out


def bench(name: str, compile_mode: str, iters: int, rounds: int, workdir: Path) -> list[dict]:
    spec = MODELS[name]
    version = workdir / f"{name}_{compile_mode}" / "1"
    version.mkdir(parents=True)
    (version / "model_src.py").write_text(spec["source"])
    options = {
        "factory": "model_src:build",
        "device": "cuda",
        "dtype": "float16",
        "compile": compile_mode,
        "batch_buckets": spec["batches"],
        "channels_last": spec.get("channels_last", False),
    }
    data = {
        "backend": "torch",
        "inputs": spec["inputs"],
        "outputs": spec["outputs"],
        "torch": options,
    }
    where = str(version.parent / "config.yaml")
    config = parse_model_config(data, version.parent.name, where)
    start = time.perf_counter()
    rt = load(config, version)
    load_s = time.perf_counter() - start
    # Plain PyTorch: the same module, built the same way, compiled the same way.
    sys.path.insert(0, str(version))
    import importlib

    module = importlib.import_module("model_src").build().cuda().half().eval()
    sys.modules.pop("model_src")
    sys.path.remove(str(version))
    if spec.get("channels_last"):
        module = module.to(memory_format=torch.channels_last)
    fn: Any = module
    if compile_mode != "none":
        mode = None if compile_mode == "default" else compile_mode
        fn = torch.compile(module, mode=mode, dynamic=False)
    # Alternating rounds (runtime, plain, runtime, ...): each figure is the median of rounds.
    rt_rounds, plain_rounds = [], []
    for _ in range(rounds):
        rt_rounds.append(runtime_rows(rt, name, spec["batches"], iters))
        plain_rounds.append(plain(name, fn, spec["batches"], iters))
    rt.close()
    runtime_ms = [statistics.median(r[i] for r in rt_rounds) for i in range(len(spec["batches"]))]
    plain_rows = [
        {
            "batch": b,
            "plain_gpu_ms": statistics.median(r[i]["plain_gpu_ms"] for r in plain_rounds),
            "plain_host_ms": statistics.median(r[i]["plain_host_ms"] for r in plain_rounds),
        }
        for i, b in enumerate(spec["batches"])
    ]
    results = []
    for row, rt_ms in zip(plain_rows, runtime_ms, strict=True):
        b = row["batch"]
        results.append(
            {
                "model": name,
                "compile": compile_mode,
                "batch": b,
                "load_s": round(load_s, 1),
                "plain_gpu_ms": round(row["plain_gpu_ms"], 3),
                "plain_host_ms": round(row["plain_host_ms"], 3),
                "runtime_ms": round(rt_ms, 3),
                "plain_gpu_rows_s": round(b / row["plain_gpu_ms"] * 1e3),
                "plain_host_rows_s": round(b / row["plain_host_ms"] * 1e3),
                "runtime_rows_s": round(b / rt_ms * 1e3),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", default="minilm:none,minilm:reduce-overhead,resnet50:none")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    print(
        f"# {torch.cuda.get_device_name()}; torch {torch.__version__}; "
        f"python {platform.python_version()}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for item in args.runs.split(","):
            name, mode = item.split(":")
            results += bench(name, mode, args.iters, args.rounds, Path(tmp))
    if args.out:
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(yaml.safe_dump(results, sort_keys=False))


if __name__ == "__main__":
    main()
