"""The generation engine in-process: continuous batching against transformers' own
``generate``, preemption, stops, aborts, the KV bound, sampling, bad input, admission."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rtserve.errors import ConfigError, InvalidInput, ObjectiveRefused  # noqa: E402
from rtserve.runtime.llm.engine import LlmEngine, StepModel  # noqa: E402
from rtserve.runtime.llm.options import LlmOptions, TokenSLO  # noqa: E402
from rtserve.runtime.llm.params import SamplingParams  # noqa: E402
from rtserve.runtime.llm.runner import release_openmp  # noqa: E402
from tests.llm_models import build_llm  # noqa: E402

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llm")
    return {arch: build_llm(root, name=arch, arch=arch) for arch in ("llama", "qwen2", "gpt2")}


def engine(version_dir: Path, **options: object) -> LlmEngine:
    opts = {"device": "cpu", "kv_cache_bytes": 8 << 20, "max_model_len": 512, "threads": 1}
    opts.update(options)
    e = LlmEngine("tiny", "1", version_dir, LlmOptions.parse(opts, "test"))
    e.start()
    return e


def reference(version_dir: Path, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(version_dir)
    out = []
    for ids in prompts:
        g = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False)
        out.append(g[0, len(ids) :].tolist())
    return out


async def run(
    e: LlmEngine, ids: list[int], params: SamplingParams = GREEDY
) -> tuple[list[int], str, str]:
    tokens: list[int] = []
    text = []
    reason = ""
    async for event in e.generate(ids, params):
        tokens += event.token_ids
        text.append(event.text)
        reason = event.finish_reason or reason
    return tokens, "".join(text), reason


def prompts_for(e: LlmEngine, n: int) -> list[list[int]]:
    words = ["the", "cat", "sat", "on", "a", "warm", "mat", "while", "rain", "fell", "outside"]
    return [e.encode_text(" ".join(words[: 1 + i % len(words)] * (1 + i % 5))) for i in range(n)]


def run_all(e: LlmEngine, prompts: list[list[int]]) -> list[tuple[list[int], str, str]]:
    """Every prompt at once (greedy); the engine stopped after."""

    async def all_at_once() -> list[tuple[list[int], str, str]]:
        try:
            return await asyncio.gather(*(run(e, p) for p in prompts))
        finally:
            await e.stop()

    return asyncio.run(all_at_once())


def check_equal(e: LlmEngine, version_dir: Path, n: int, **options: object) -> None:
    prompts = prompts_for(e, n)
    got = run_all(e, prompts)
    want = reference(version_dir, prompts, GREEDY.max_tokens or 0)
    tok = e.tokenizer
    for (tokens, text, _), expected in zip(got, want, strict=True):
        assert tokens == expected
        assert text == tok.decode(expected, skip_special_tokens=True)


def test_64_concurrent_greedy_equal_generate_one_at_a_time(models: dict[str, Path]) -> None:
    e = engine(models["llama"], block_size=4, max_num_batched_tokens=64)
    check_equal(e, models["llama"], 64)
    assert e.steps < 64 * 12  # batched: far fewer steps than tokens


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_other_architectures_equal_generate(models: dict[str, Path], arch: str) -> None:
    check_equal(engine(models[arch], block_size=8), models[arch], 12)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@CUDA
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_cuda_greedy_equals_generate(models: dict[str, Path], arch: str) -> None:
    e = engine(models[arch], device="cuda", block_size=8)
    assert e.runner.device.type == "cuda"
    assert all(k.device.type == "cuda" for k in e.runner.k_cache)
    check_equal(e, models[arch], 16)
    assert e.pool.num_used == 0


@CUDA
def test_cuda_float16_batches_and_frees_its_blocks(models: dict[str, Path]) -> None:
    e = engine(models["llama"], device="cuda", dtype="float16", block_size=8)
    assert e.runner.k_cache[0].dtype == torch.float16
    prompts = prompts_for(e, 24)
    results = run_all(e, prompts)
    assert [len(tokens) for tokens, _, _ in results] == [GREEDY.max_tokens] * len(prompts)
    assert {reason for _, _, reason in results} == {"length"}
    assert e.steps < 24 * 12  # batched
    assert e.pool.num_used == 0


def test_a_sliding_window_caps_max_model_len_where_full_attention_is_exact(
    tmp_path: Path,
) -> None:
    window = 40
    version = build_llm(tmp_path, arch="mistral", extra={"sliding_window": window})
    e = engine(version, block_size=8)
    assert e.runner.max_model_len == window  # (512 asked)
    with pytest.raises(InvalidInput, match=f"max_model_len \\({window}\\)"):
        e.check_prompt(window, GREEDY)
    short = [p for p in prompts_for(e, 12) if len(p) + GREEDY.max_tokens <= window]
    assert len(short) >= 6
    got = run_all(e, short)
    assert [tokens for tokens, _, _ in got] == reference(version, short, GREEDY.max_tokens or 0)


def _logprobs(model: object, ids: list[int], new: list[int]) -> list[float]:
    """The log-probability transformers gives each of ``new`` after ``ids``."""
    full = torch.tensor([ids + new])
    with torch.no_grad():
        lp = torch.log_softmax(model(full).logits[0].float(), -1)  # type: ignore[operator]
    return [float(lp[len(ids) - 1 + i, t]) for i, t in enumerate(new)]


def test_soft_capped_attention_gives_transformers_log_probabilities(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    version = build_llm(tmp_path, arch="gemma2", extra={"attn_logit_softcapping": 0.3})
    model = AutoModelForCausalLM.from_pretrained(version)
    with torch.no_grad():  # sharper attention: scores far into the cap's curve
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(6.0)
    model.save_pretrained(version)
    e = engine(version, block_size=8)
    assert e.runner.decode_kernel is None  # (the kernel has no soft-capping)
    prompts = prompts_for(e, 6)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)

    async def go() -> list[tuple[list[int], list[float]]]:
        async def one(ids: list[int]) -> tuple[list[int], list[float]]:
            tokens: list[int] = []
            lps: list[float] = []
            async for event in e.generate(ids, params):
                tokens += event.token_ids
                lps += [lp.logprob for lp in event.logprobs or []]
            return tokens, lps

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await e.stop()

    uncapped = AutoModelForCausalLM.from_pretrained(version, attn_logit_softcapping=None)
    moved = 0.0
    for ids, (tokens, lps) in zip(prompts, asyncio.run(go()), strict=True):
        assert len(lps) == len(tokens) == 8
        assert lps == pytest.approx(_logprobs(model, ids, tokens), abs=2e-4)
        plain = _logprobs(uncapped, ids, tokens)
        moved = max(moved, *(abs(a - b) for a, b in zip(lps, plain, strict=True)))
    assert moved > 1e-2  # the cap changes the answer: the test can tell


def test_architectures_without_the_attention_interface_are_refused(tmp_path: Path) -> None:
    version = build_llm(tmp_path, arch="bloom")
    with pytest.raises(ConfigError, match="BloomForCausalLM .* attention interface"):
        LlmEngine("tiny", "1", version, LlmOptions.parse({"device": "cpu"}, "test"))


def test_preemption_and_recompute_give_the_same_text(models: dict[str, Path]) -> None:
    # 160 token slots for 24 sequences of up to ~60 tokens: sequences are preempted.
    e = engine(models["llama"], block_size=4, kv_cache_bytes=80 << 10)
    check_equal(e, models["llama"], 24)
    assert e.scheduler.preemptions > 0
    assert e.pool.num_used == 0


def test_prefix_cache_hits_on_a_shared_prompt(models: dict[str, Path]) -> None:
    e = engine(models["llama"], block_size=4)
    shared = e.encode_text("the cat sat on a warm mat " * 6)

    async def go() -> None:
        try:
            first = await run(e, shared)
            second = await run(e, shared)
            assert first == second
        finally:
            await e.stop()

    asyncio.run(go())
    assert e.pool.hits >= len(shared) // 4 - 1


def test_stop_string_and_eos_end_the_sequence(models: dict[str, Path], tmp_path: Path) -> None:
    e = engine(models["llama"])
    ids = prompts_for(e, 1)[0]
    full_tokens, full_text, _ = asyncio.run(
        run(e, ids, SamplingParams(max_tokens=12, temperature=0))
    )
    asyncio.run(e.stop())
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 2]
    assert stop.strip(), full_text
    e = engine(models["llama"])
    params = SamplingParams(max_tokens=12, temperature=0, stop=(stop,))
    tokens, text, reason = asyncio.run(run(e, ids, params))
    asyncio.run(e.stop())
    assert reason == "stop"
    assert text == full_text[: full_text.index(stop)]
    assert len(tokens) < len(full_tokens)

    # EOS: a copy of the model whose end-of-sequence token is the 4th one greedy makes.
    version = tmp_path / "eos" / "1"
    version.mkdir(parents=True)
    for f in models["llama"].iterdir():
        (version / f.name).write_bytes(f.read_bytes())
    gen = json.loads((version / "generation_config.json").read_text())
    gen["eos_token_id"] = full_tokens[3]
    (version / "generation_config.json").write_text(json.dumps(gen))
    e = engine(version)
    tokens, _, reason = asyncio.run(run(e, ids))
    asyncio.run(e.stop())
    assert reason == "stop"
    assert tokens == full_tokens[: full_tokens.index(full_tokens[3]) + 1]


def test_cancelled_sequences_free_their_blocks_and_the_engine_goes_idle(
    models: dict[str, Path],
) -> None:
    e = engine(models["llama"])
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def go() -> None:
        async def consume(ids: list[int]) -> None:
            async for _ in e.generate(ids, long):
                pass

        tasks = [asyncio.create_task(consume(p)) for p in prompts_for(e, 16)]
        while e.steps < 5:
            await asyncio.sleep(0.01)
        assert e.pool.num_used > 0
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(200):
            if not e.busy:
                break
            await asyncio.sleep(0.01)
        steps = e.steps
        await asyncio.sleep(0.2)
        assert e.steps == steps  # no decoding for nobody
        await e.stop()

    asyncio.run(go())
    assert not e.busy
    assert e.pool.num_used == 0
    assert not e.scheduler.running and not e.scheduler.waiting
    assert e.metrics.finished["abort"] == 16


def test_kv_pool_bounds_memory_under_500_concurrent_requests(models: dict[str, Path]) -> None:
    e = engine(models["llama"], kv_cache_bytes=256 << 10, max_num_seqs=64)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = prompts_for(e, 500)
    peak_blocks = 0

    async def go() -> None:
        nonlocal peak_blocks

        async def watch() -> None:
            nonlocal peak_blocks
            while True:
                peak_blocks = max(peak_blocks, e.pool.num_used)
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        results = await asyncio.gather(*(run(e, p, params) for p in prompts))
        watcher.cancel()
        assert all(len(tokens) == 8 for tokens, _, _ in results)
        await e.stop()

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    asyncio.run(go())
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert 0 < peak_blocks <= e.pool.num_blocks
    assert e.pool.num_used == 0
    assert after - before < 200_000  # KiB: the pool is fixed; only request objects came and went


def test_seeded_sampling_is_reproducible(models: dict[str, Path]) -> None:
    e = engine(models["llama"])
    ids = prompts_for(e, 1)[0]

    def sampled(seed: int) -> list[int]:
        # (the test model's logits are sharp: sample hot, so that seeds differ)
        params = SamplingParams(max_tokens=16, temperature=2.0, top_p=0.99, top_k=200, seed=seed)
        return asyncio.run(run(e, ids, params))[0]

    try:
        assert sampled(7) == sampled(7)
        assert sampled(7) != sampled(8)
    finally:
        asyncio.run(e.stop())


def test_bad_input_is_refused_with_the_field_named(models: dict[str, Path]) -> None:
    e = engine(models["llama"], max_model_len=64)
    try:
        with pytest.raises(InvalidInput, match="prompt: 80 tokens"):
            e.check_prompt(80, GREEDY)
        with pytest.raises(InvalidInput, match="max_tokens"):
            e.check_prompt(40, SamplingParams(max_tokens=40))
        with pytest.raises(InvalidInput, match="max_tokens"):
            SamplingParams.from_mapping({"max_tokens": -1})
        with pytest.raises(InvalidInput, match="temperature"):
            SamplingParams.from_mapping({"temperature": "hot"})
        with pytest.raises(InvalidInput, match=r"messages\[0\].role"):
            e.encode_messages([{"role": "wizard", "content": "hi"}])
        with pytest.raises(InvalidInput, match=r"messages\[1\].content"):
            e.encode_messages([{"role": "user", "content": "hi"}, {"role": "user"}])
        with pytest.raises(InvalidInput, match="messages"):
            e.encode_messages("hello")
        with pytest.raises(InvalidInput, match="token ids"):
            asyncio.run(run(e, [1, 10**9]))
        assert asyncio.run(run(e, e.encode_text("still serving")))[0]
    finally:
        asyncio.run(e.stop())


def test_first_token_objective_refuses_at_once_when_overloaded(models: dict[str, Path]) -> None:
    e = engine(
        models["llama"],
        max_num_seqs=2,
        max_num_batched_tokens=16,
        block_size=16,
        slo={"ttft_p99_ms": 50},
    )
    assert e.options.slo == TokenSLO(ttft_p99_ms=50.0)
    long_prompt = e.encode_text("the cat sat on a warm mat " * 30)
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)

    async def go() -> None:
        queued = []
        try:
            for _ in range(40):  # admitted while the estimate allows, then refused at once
                task = asyncio.create_task(run(e, long_prompt, params))
                queued.append(task)
                await asyncio.sleep(0)
                if task.done():
                    break
            with pytest.raises(ObjectiveRefused, match="ttft_p99_ms=50"):
                await asyncio.wait_for(run(e, long_prompt, params), 1.0)
        finally:
            for t in queued:
                t.cancel()
            await asyncio.gather(*queued, return_exceptions=True)
            await e.stop()

    asyncio.run(go())
    assert e.metrics.refused >= 1


def test_step_model_tail_is_how_much_slower_slow_steps_run() -> None:
    """Steady steps fit with a tail of 1; when one step in ten takes 1.6x its fit, the tail
    (95th percentile of measured / fitted) reads about that, and the fit stays put."""
    steady = StepModel()
    for i in range(64):
        steady.add(i % 8, 16 * (i % 3), 0.01 + 0.001 * (i % 8) + 0.0001 * 16 * (i % 3))
    assert steady.tail == pytest.approx(1.0, abs=1e-6)
    assert steady.time(4, 0) == pytest.approx(0.014, rel=1e-6)
    noisy = StepModel()
    for i in range(200):
        base = 0.01 + 0.001 * (i % 8)
        noisy.add(i % 8, 0, base * (1.6 if i % 10 == 0 else 1.0))
    assert 1.4 < noisy.tail < 1.7
    assert noisy.time(0, 0) == pytest.approx(0.0106, rel=0.05)


def test_first_token_wait_counts_the_step_in_progress_and_the_tail(
    models: dict[str, Path],
) -> None:
    e = engine(models["llama"], slo={"ttft_p99_ms": 500})
    try:
        e.step_model.coef = (0.01, 0.001, 0.0001)
        e.step_model.tail = 1.0
        idle = e.first_token_wait(20)
        assert idle == pytest.approx(0.01 + 0.0001 * 20, rel=1e-6)
        e._step_started, e._step_expected = time.perf_counter(), 0.3  # a long step began
        busy = e.first_token_wait(20)
        assert 0.25 < busy - idle <= 0.3
        e.step_model.tail = 2.0
        assert e.first_token_wait(20) == pytest.approx(2 * busy, rel=0.05)
        e._step_started = 0.0
        with pytest.raises(ObjectiveRefused, match="ttft_p99_ms=500"):  # 2 x 0.302 s
            e.step_model.coef = (0.3, 0.001, 0.0001)
            e.check_prompt(20, GREEDY)
    finally:
        asyncio.run(e.stop())


def test_an_admitted_request_is_not_refused_again_when_it_starts(
    models: dict[str, Path],
) -> None:
    """The server admits (``check_prompt``) before a stream's status line goes out; the
    generation it then starts (``checked=True``) must not be refused by a second estimate."""
    e = engine(models["llama"], slo={"ttft_p99_ms": 500})
    ids = e.encode_text("the cat sat")
    try:
        e.check_prompt(len(ids), GREEDY)
        e.step_model.coef = (1.0, 0.001, 0.0001)  # the estimate worsens after admission

        async def go() -> list[int]:
            with pytest.raises(ObjectiveRefused):
                await run(e, ids)
            tokens = []
            async for event in e.generate(ids, GREEDY, checked=True):
                tokens += event.token_ids
            return tokens

        assert len(asyncio.run(go())) == GREEDY.max_tokens
    finally:
        asyncio.run(e.stop())


def test_inter_token_objective_limits_prompt_chunks_beside_decodes(
    models: dict[str, Path],
) -> None:
    """With ``itl_p99_ms``, a long prompt joins running sequences in chunks small enough
    for their pace; without it, in chunks as large as the token budget allows."""

    def largest_chunk_beside_decodes(**options: object) -> int:
        e = engine(models["llama"], max_num_batched_tokens=256, block_size=4, **options)
        e.warmup()
        decoding = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
        long_prompt = e.encode_text("the cat sat on a warm mat " * 40)

        async def go() -> None:
            try:
                start = e.steps
                runners = [asyncio.create_task(run(e, p, decoding)) for p in prompts_for(e, 4)]
                while e.steps < start + 8:
                    await asyncio.sleep(0.001)
                await run(e, long_prompt, GREEDY)
                await asyncio.gather(*runners)
            finally:
                await e.stop()

        e.step_model._rows.clear()
        asyncio.run(go())
        return max(p for d, p, _ in e.step_model._rows if d > 0)

    free = largest_chunk_beside_decodes()
    paced = largest_chunk_beside_decodes(slo={"itl_p99_ms": 1})
    assert free > 100
    assert paced < free / 4


def test_release_openmp_ends_the_threads_worker_pool() -> None:
    """Loading leaves an OpenMP pool on the loading thread; releasing it ends its workers
    (while they live, libgomp stops spinning in the step loop's own pool)."""

    def threads() -> set[str]:
        return set(os.listdir("/proc/self/task"))

    before_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        release_openmp()
        idle = threads()
        torch.ones(1 << 22).mul_(2)  # a parallel op: this thread gets a worker
        workers = threads() - idle
        assert workers
        assert release_openmp()
        deadline = time.monotonic() + 2
        while workers & threads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not workers & threads()
    finally:
        torch.set_num_threads(before_threads)
