"""Decode step of the ``image-classifier`` example: JPEG/PNG bytes -> EfficientNet input.

Each image is decoded with Pillow (JPEGs at reduced size through ``draft`` when they are
large), converted to RGB, resized so its shorter side is 256, centre-cropped to 224x224 and
normalised as EfficientNet-Lite expects ((x - 127) / 128), channels first. An empty input
becomes a blank (all-zero) image: that is what the server's warmup sends.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

SIZE = 224
RESIZE = 256
MAX_PIXELS = 40_000_000  # refuse decompression bombs before decoding them

Image.MAX_IMAGE_PIXELS = MAX_PIXELS


def preprocess(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        if image.width * image.height > MAX_PIXELS:
            raise ValueError(f"image of {image.width}x{image.height} pixels is too large")
        image.draft("RGB", (RESIZE, RESIZE))  # JPEG: decode at a smaller scale when possible
        rgb = image.convert("RGB")
    scale = RESIZE / min(rgb.size)
    size = (max(SIZE, round(rgb.width * scale)), max(SIZE, round(rgb.height * scale)))
    rgb = rgb.resize(size, Image.Resampling.BILINEAR)
    left, top = (rgb.width - SIZE) // 2, (rgb.height - SIZE) // 2
    rgb = rgb.crop((left, top, left + SIZE, top + SIZE))
    pixels = (np.asarray(rgb, dtype=np.float32) - 127.0) / 128.0
    return pixels.transpose(2, 0, 1)


class Model:
    def load(self, context: Any) -> None:
        pass

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        images = inputs["image"].reshape(-1)
        out = np.empty((len(images), 3, SIZE, SIZE), dtype=np.float32)
        for row, data in enumerate(images):
            out[row] = preprocess(data) if data else 0.0
        return {"pixels": out}
