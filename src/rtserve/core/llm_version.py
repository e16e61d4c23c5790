"""``backend: llm``: a Hugging Face causal-LM directory as a live model version.

The version's ``llm`` engine serves the generative APIs (OpenAI, Triton generate, gRPC
streaming). Plain V2 ``infer`` works too: ``text_input`` (BYTES) in, the whole answer as
``text_output`` out, with the config's default sampling (greedy unless set; a sampling
parameter in the request is refused, naming it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from rtserve.config import ModelConfig, TensorSpec
from rtserve.core.capabilities import GENERATE
from rtserve.core.model import BuildContext, ModelVersion, Outputs
from rtserve.errors import ConfigError, InvalidInput, RTServeError
from rtserve.extras import install_hint
from rtserve.protocol.limits import limits_for_model
from rtserve.protocol.types import Timings
from rtserve.runtime.llm.metrics import LlmCollector
from rtserve.runtime.llm.options import LlmOptions
from rtserve.runtime.llm.params import SamplingParams

if TYPE_CHECKING:  # (torch is imported when the first generative model loads)
    from rtserve.runtime.llm.engine import LlmEngine

log = logging.getLogger(__name__)

TEXT_INPUT = TensorSpec("text_input", "BYTES", (1,))
TEXT_OUTPUT = TensorSpec("text_output", "BYTES", (1,))
# A stream request's scalar inputs besides text_input (sampling parameters, "stream", ...).
SCALAR_INPUTS = 32


def _text_input(feeds: dict[str, np.ndarray]) -> str:
    """The one string of a V2 request's ``text_input``."""
    value = feeds["text_input"].reshape(-1)
    if value.size != 1:
        raise InvalidInput(f"text_input: expected one string, got {value.size}")
    raw = value[0]
    if not isinstance(raw, bytes):
        return str(raw)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidInput("text_input: expected UTF-8 text") from None


class GenerateScheduler:
    """The dataplane's scheduler for a generative version: each V2 infer request is one
    generation in the engine's running batch."""

    def __init__(self, engine: LlmEngine) -> None:
        self.engine = engine
        self._tasks: set[asyncio.Task[None]] = set()
        self.params = SamplingParams(max_tokens=engine.options.default_max_tokens, temperature=0.0)

    def submit(
        self,
        feeds: dict[str, np.ndarray],
        rows: int,
        timings: Timings,
        timeout_s: float = 0.0,
        priority: object = None,
        on_done: Callable[[asyncio.Future[Outputs]], object] | None = None,
    ) -> asyncio.Future[Outputs]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outputs] = loop.create_future()
        if on_done is not None:
            future.add_done_callback(on_done)
        task = loop.create_task(self._run(feeds, future))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return future

    async def _run(self, feeds: dict[str, np.ndarray], future: asyncio.Future[Outputs]) -> None:
        try:
            ids = self.engine.encode_text(_text_input(feeds))
            # (llm.default_max_tokens, within what the context leaves after the prompt)
            room = max(1, self.engine.max_model_len - len(ids))
            params = self.params
            if params.max_tokens is not None and params.max_tokens > room:
                params = dataclasses.replace(params, max_tokens=room)
            parts = []
            async for event in self.engine.generate(ids, params):
                parts.append(event.text)
            out = np.array(["".join(parts).encode()], dtype=np.object_)
            if not future.done():
                future.set_result({"text_output": out})
        except RTServeError as exc:
            if not future.done():
                future.set_exception(exc)
        finally:
            if not future.done():
                future.cancel()

    def refuse_early(self, received_ns: int) -> RTServeError | None:
        return None

    @property
    def queue_depth(self) -> int:
        return len(self.engine.scheduler.waiting)

    @property
    def busy(self) -> bool:
        return self.engine.busy

    async def drain(self) -> None:
        await self.engine.drain()

    async def stop(self) -> None:
        await self.engine.stop()


async def build_llm_version(
    config: ModelConfig, version_dir: Path, version: str, ctx: BuildContext
) -> ModelVersion:
    """Load the model and tokenizer, allocate the KV pool, warm up, start the step loop."""
    options = LlmOptions.parse(config.backend_options, config.source)
    loop = asyncio.get_running_loop()

    def load() -> LlmEngine:
        from rtserve.runtime.llm.engine import LlmEngine

        engine = LlmEngine(config.name, version, version_dir, options)
        described = engine.sampling_defaults.describe()
        log.info(
            "llm %s: requests that set none get %s; answers without max_tokens stop at %d "
            "tokens (llm.default_max_tokens)",
            config.name,
            f"{described} (generation_config.json)" if described else "OpenAI's sampling",
            options.default_max_tokens,
        )
        engine.warmup()
        return engine

    try:
        engine = await loop.run_in_executor(None, load)
    except ConfigError:
        raise
    except Exception as exc:
        log.error("loading %s failed", version_dir, exc_info=exc)
        hint = install_hint(exc, "llm")
        raise ConfigError(
            f"{version_dir}: loading failed: {type(exc).__name__}: {exc}{hint}"
        ) from exc
    engine.start()
    collector = ctx.metrics.collector("llm", LlmCollector)
    assert isinstance(collector, LlmCollector)
    collector.models = [
        m for m in collector.models if (m.model, m.version) != (config.name, version)
    ] + [engine.metrics]
    metrics = ctx.metrics.model(config.name, version)
    scheduler = GenerateScheduler(engine)
    metrics.track_queue_depth(lambda: scheduler.queue_depth)
    mv = ModelVersion(
        name=config.name,
        version=version,
        config=dataclasses.replace(config, max_batch_size=0),
        platform="pytorch_llm",
        scheduler=scheduler,
        metrics=metrics,
        inputs={TEXT_INPUT.name: TEXT_INPUT},
        outputs={TEXT_OUTPUT.name: TEXT_OUTPUT},
        decode_limits=limits_for_model(
            (TEXT_INPUT, *[TensorSpec(f"scalar{i}", "BYTES", (1,)) for i in range(SCALAR_INPUTS)]),
            1,
            ctx.decode_limits,
        ),
        capabilities={GENERATE: engine},
    )
    engine.on_failed = lambda: setattr(mv, "ready", False)
    return mv
