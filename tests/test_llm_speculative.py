"""Speculative decoding (``llm.speculative``): prompt lookup and a draft model give greedy
output token for token the same as plain decoding (concurrently, with preemption), sampled
output keeps its distribution, drafted/accepted tokens are on /metrics, no KV block leaks,
bad draft configurations are refused at load, and a large batch turns speculation off."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rtserve.errors import ConfigError  # noqa: E402
from rtserve.runtime.llm.engine import LlmEngine  # noqa: E402
from rtserve.runtime.llm.options import LlmOptions  # noqa: E402
from rtserve.runtime.llm.params import SamplingParams  # noqa: E402
from rtserve.runtime.llm.speculative import (  # noqa: E402
    draft_tokens,
    probabilities,
    propose_ngram,
    replay,
    verify_greedy,
    verify_sampled,
)
from tests.conftest import start_server  # noqa: E402
from tests.llm_models import build_llm, build_tokenizer  # noqa: E402

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LOOKUP = {"method": "prompt_lookup", "num_tokens": 4, "max_batch": 64}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("spec")
    build_llm(root, name="llama", arch="llama")
    build_llm(root, name="qwen2", arch="qwen2")
    build_llm(root, name="small", arch="llama", layers=1, seed=3)  # same tokenizer
    return root


def engine(version_dir: Path, spec: dict | None, **options: object) -> LlmEngine:
    opts: dict = {"device": "cpu", "kv_cache_bytes": 8 << 20, "max_model_len": 512, "threads": 1}
    opts.update(options)
    if spec is not None:
        opts["speculative"] = spec
    e = LlmEngine("tiny", "1", version_dir, LlmOptions.parse(opts, "test/config.yaml"))
    e.start()
    return e


def prompts_for(e: LlmEngine, n: int) -> list[list[int]]:
    """Prompts that repeat themselves (prompt lookup finds n-grams in them)."""
    words = ["the", "cat", "sat", "on", "a", "warm", "mat", "while", "rain", "fell", "outside"]
    return [
        e.encode_text(" ".join(words[i % 5 : i % 5 + 2 + i % 7] * (2 + i % 4))) for i in range(n)
    ]


async def run(e: LlmEngine, ids: list[int], params: SamplingParams = GREEDY) -> list[int]:
    tokens: list[int] = []
    async for event in e.generate(ids, params):
        tokens += event.token_ids
    return tokens


def run_all(e: LlmEngine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list:
    async def go() -> list:
        try:
            return await asyncio.gather(*(run(e, p, params) for p in prompts))
        finally:
            await e.stop()

    return asyncio.run(go())


# ------------------------------------------------------------------ pure parts
def test_prompt_lookup_drafts_what_followed_the_latest_match() -> None:
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, 2, 3) == [7, 5, 1]
    assert propose_ngram([5, 6, 7, 8], 3, 1, 3) == []  # nothing repeats
    assert propose_ngram([4, 4, 4], 2, 1, 2) == [4]  # only what exists after the match
    assert propose_ngram([1, 2, 3], 0, 1, 2) == []


def test_prompt_lookup_drafts_no_more_than_its_match_and_stops_where_matches_part() -> None:
    # a one-token match drafts one token (it used to draft k)
    assert propose_ngram([7, 8, 1, 2, 3, 4, 5, 6, 9, 8], 4, 1, 4) == [1]
    # a longer match drafts as long as it is
    assert propose_ngram([6, 7, 8, 1, 2, 3, 4, 5, 9, 6, 7, 8], 6, 1, 4) == [1, 2, 3]
    # three matches of "1 2" continue "5 7", "5 7", "5 6": the latest is followed while
    # most of them agree ("5"), and no further
    tokens = [8, 1, 2, 5, 7, 9, 1, 2, 5, 7, 4, 1, 2, 5, 6, 3, 1, 2]
    assert propose_ngram(tokens, 4, 2, 4) == [5]
    assert propose_ngram(tokens[10:], 4, 2, 4) == [5, 6]  # one match: followed on


def test_drafts_shrink_as_more_sequences_decode() -> None:
    # each sequence verifies its drafts and its own token, 16 tokens a step in all
    assert [draft_tokens(6, b, 64) for b in (1, 2, 3, 4, 5, 8, 9, 32)] == [6, 6, 4, 3, 2, 1, 0, 0]
    assert draft_tokens(6, 3, 2) == 0  # past max_batch: none
    assert draft_tokens(6, 32, 64, step_tokens=1 << 20) == 6


def test_replayed_acceptance_equals_the_engines_count(repo: Path) -> None:
    """Drafted and accepted tokens are a function of the text alone (greedy): prompt
    lookup replayed on the output counts what the engine counted."""
    spec = {"method": "prompt_lookup", "num_tokens": 5, "ngram": {"min": 1, "max": 4}}
    e = engine(repo / "llama" / "1", spec)
    ids = prompts_for(e, 4)[3]
    out = run_all(e, [ids])[0]
    steps, drafted, accepted = replay(ids, out, 5, 1, 4)
    assert (e.metrics.drafted, e.metrics.accepted) == (drafted, accepted)
    assert accepted > 0 and steps < len(out)


def test_greedy_verification_keeps_the_agreeing_run_and_the_models_token() -> None:
    assert verify_greedy([5, 6, 7], [5, 6, 8, 9]) == [5, 6, 8]
    assert verify_greedy([5, 6, 7], [5, 6, 7, 9]) == [5, 6, 7, 9]
    assert verify_greedy([5], [4, 0]) == [4]


@pytest.mark.parametrize("with_draft_model", [False, True])
def test_rejection_sampling_keeps_the_models_distribution(with_draft_model: bool) -> None:
    """On a 16-token vocabulary: the first two tokens of 40,000 verifications are
    distributed as the target's own (chi-square per token, and total variation)."""
    vocab, k, n = 16, 3, 40_000
    g = torch.Generator().manual_seed(0)
    target = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, dim=-1)
    draft_probs = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, dim=-1)
    fixed = target[:k].argmax(dim=-1).tolist()  # prompt lookup's drafts: certain
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)  # given the first was the draft's first token
    accepted = 0
    for _ in range(n):
        if with_draft_model:
            draft = [int(torch.multinomial(draft_probs[j], 1, generator=g)) for j in range(k)]
            out = verify_sampled(draft, target, draft_probs, g)
        else:
            draft = fixed
            out = verify_sampled(draft, target, None, g)
        first[out[0]] += 1
        accepted += len(out) - 1
        if len(out) > 1 and out[0] == draft[0]:
            second[out[1]] += 1
    assert accepted > n // 4  # drafts were kept often: the acceptance path was tested
    for counts, p in ((first, target[0]), (second, target[1])):
        total = counts.sum()
        expected = p * total
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 45.0, (chi2, counts, expected)  # 15 dof: p < 1e-4 beyond this
        assert float((counts / total - p).abs().sum()) / 2 < 0.03


def test_probabilities_match_the_samplers_filters() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 5.0, 0.0, -1.0]])
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    assert p[0, :2].sum() == 0 and abs(float(p[0].sum()) - 1) < 1e-6
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert p[0].tolist() == [0.0, 0.0, 0.0, 1.0]  # the smallest set reaching 0.5, normalised
    assert p[1, 2:].sum() == 0 and abs(float(p[1, 0]) - 0.5) < 1e-6
    bad = probabilities(torch.tensor([[float("nan"), 1.0]]), SamplingParams(temperature=1.0))
    assert bad.tolist() == [[0.0, 1.0]]


# ------------------------------------------------------------------ the engine
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prompt_lookup_greedy_equals_plain_64_concurrent_with_preemption(
    repo: Path, arch: str
) -> None:
    version = repo / arch / "1"
    small = {"kv_cache_bytes": 1 << 17, "block_size": 4}  # 256 token slots: preemption
    plain = engine(version, None, **small)
    prompts = prompts_for(plain, 64)
    expected = run_all(plain, prompts)
    spec = engine(version, LOOKUP, **small)
    assert spec.speculator is not None
    spec.speculator.step_tokens = 1 << 20  # drafts at every batch size
    got = run_all(spec, prompts)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a == b, f"prompt {i}: {a} != {b}"
    assert spec.scheduler.preemptions > 0
    assert spec.metrics.accepted > 0 and spec.metrics.drafted >= spec.metrics.accepted
    assert spec.pool.num_used == 0  # every block back, the rejected drafts' too


def test_draft_model_greedy_equals_plain_concurrent_with_preemption(repo: Path) -> None:
    version = repo / "llama" / "1"
    small = {"kv_cache_bytes": 1 << 17, "block_size": 4}
    plain = engine(version, None, **small)
    prompts = prompts_for(plain, 24)
    expected = run_all(plain, prompts)
    for draft in ("llama", "small"):  # itself (all kept) and a smaller model
        spec = engine(
            version,
            {"method": "draft", "draft_model": draft, "num_tokens": 3, "max_batch": 64},
            **small,
        )
        assert run_all(spec, prompts) == expected
        assert spec.scheduler.preemptions > 0
        assert spec.pool.num_used == 0
        assert spec.speculator is not None and spec.speculator.draft is not None
        assert spec.speculator.draft.states == {}  # every draft cache dropped
        if draft == "llama":
            assert spec.metrics.accepted == spec.metrics.drafted > 0


def test_stop_strings_logprobs_and_max_tokens_with_drafts(repo: Path) -> None:
    version = repo / "llama" / "1"
    plain = engine(version, None)
    prompts = prompts_for(plain, 6)
    cases = [
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=30, temperature=0.0, stop=("at",)),
    ]

    async def go(e: LlmEngine) -> list:
        out = []
        try:
            for params in cases:
                for p in prompts:
                    events = [ev async for ev in e.generate(p, params)]
                    out.append(
                        (
                            "".join(ev.text for ev in events),
                            [t for ev in events for t in ev.token_ids],
                            [
                                (lp.token, round(lp.logprob, 4))
                                for ev in events
                                for lp in ev.logprobs or []
                            ],
                            events[-1].finish_reason,
                        )
                    )
        finally:
            await e.stop()
        return out

    expected = asyncio.run(go(plain))
    spec = engine(version, LOOKUP)
    assert asyncio.run(go(spec)) == expected
    assert spec.metrics.accepted > 0
    assert all(len(t[1]) == 7 for t in expected[: len(prompts)])


@pytest.mark.parametrize("method", ["prompt_lookup", "draft"])
def test_sampled_output_keeps_its_distribution_through_the_engine(repo: Path, method: str) -> None:
    """The second to fourth tokens (drafted and verified) of 300 sampled answers, with and
    without speculation: the same distribution (chi-square test of homogeneity), with
    drafts both kept and rejected."""
    version = repo / "llama" / "1"
    params = SamplingParams(max_tokens=4, temperature=1.5, top_k=8, ignore_eos=True)
    spec: dict = {"method": method, "num_tokens": 2, "max_batch": 4096}
    if method == "draft":
        spec["draft_model"] = "small"
    else:
        spec["ngram"] = {"min": 1, "max": 2}

    def tokens(spec: dict | None) -> tuple[list[list[int]], LlmEngine]:
        e = engine(version, spec, max_num_seqs=512)
        if e.speculator is not None:
            e.speculator.step_tokens = 1 << 20  # drafts at every batch size
        ids = e.encode_text("the cat sat on the mat the cat sat on the mat the cat")
        return run_all(e, [ids] * 300, params), e

    base, _ = tokens(None)
    got, e = tokens(spec)
    assert e.metrics.drafted > e.metrics.accepted > 20  # both paths were exercised
    for pos in (1, 2, 3):
        a = torch.bincount(torch.tensor([t[pos] for t in base]), minlength=512).double()
        b = torch.bincount(torch.tensor([t[pos] for t in got]), minlength=512).double()
        keep = (a + b) > 0
        a, b = a[keep], b[keep]
        expected_a = (a + b) * a.sum() / (a.sum() + b.sum())
        expected_b = (a + b) * b.sum() / (a.sum() + b.sum())
        chi2 = float(
            ((a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b).sum()
        )
        dof = max(1, int(keep.sum()) - 1)
        assert chi2 < dof + 6 * (2 * dof) ** 0.5 + 10, (pos, chi2, dof)


def test_a_large_batch_turns_speculation_off(repo: Path) -> None:
    version = repo / "llama" / "1"
    spec = {"method": "prompt_lookup", "num_tokens": 4, "max_batch": 2}
    e = engine(version, spec)
    prompts = prompts_for(e, 8)[:1] * 8  # 8 at once, all finishing in the same step
    run_all(e, prompts)
    assert e.metrics.drafted == 0
    e = engine(version, spec)
    run_all(e, prompts[:2])
    assert e.metrics.drafted > 0


def test_a_request_may_opt_out(repo: Path) -> None:
    e = engine(repo / "llama" / "1", LOOKUP)
    ids = prompts_for(e, 3)[2]

    async def go() -> None:
        try:
            async for _ in e.generate(ids, GREEDY, speculate=False):
                pass
        finally:
            await e.stop()

    asyncio.run(go())
    assert e.metrics.drafted == 0


# ------------------------------------------------------------------ configuration
def test_bad_speculative_configurations_are_refused_naming_file_and_field(
    repo: Path, tmp_path: Path
) -> None:
    version = repo / "llama" / "1"
    where = "test/config.yaml"
    cases = [
        ({"method": "medusa"}, "llm.speculative.method"),
        ({"num_tokens": 0}, "llm.speculative.num_tokens"),
        ({"ngram": {"min": 3, "max": 2}}, "llm.speculative.ngram.max"),
        ({"method": "draft"}, "llm.speculative.draft_model"),
        ({"speed": 2}, "llm.speculative.speed"),
    ]
    for spec, field in cases:
        with pytest.raises(ConfigError, match=rf"{where}: {field}"):
            LlmOptions.parse({"speculative": spec}, where)
    # another tokenizer, a missing model, a larger vocabulary: refused at load
    other = build_llm(repo, name="other-tokenizer", arch="llama")
    build_tokenizer(vocab_size=350).save_pretrained(other)
    build_llm(repo, name="wide", arch="llama", extra={"vocab_size": 1024})
    for name, why in [
        ("missing", "no model 'missing' in the repository"),
        ("other-tokenizer", "another tokenizer"),
        ("wide", "larger vocabulary"),
    ]:
        with pytest.raises(ConfigError, match=rf"{where}: llm.speculative.draft_model: .*{why}"):
            engine(version, {"method": "draft", "draft_model": name})


def test_drafted_and_accepted_tokens_on_metrics_and_kv_back_to_zero(
    tmp_path: Path,
) -> None:
    import json

    build_llm(tmp_path / "repo", name="tiny", llm={"speculative": LOOKUP})
    server = start_server(tmp_path / "repo", tmp_path / "work")
    try:
        body = {
            "model": "tiny",
            "prompt": "the cat sat on the mat the cat sat on the mat the cat sat",
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
        }
        req = urllib.request.Request(
            f"{server.base}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        for _ in range(3):
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert resp.status == 200
        with urllib.request.urlopen(f"{server.base}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        server.stop()

    def value(name: str) -> float:
        lines = [ln for ln in text.splitlines() if ln.startswith(name + "{")]
        assert lines, name
        return float(lines[0].rsplit(" ", 1)[1])

    drafted = value("rtserve_llm_speculative_draft_tokens_total")
    accepted = value("rtserve_llm_speculative_accepted_tokens_total")
    assert drafted >= accepted > 0
    assert value("rtserve_llm_kv_blocks_used") == 0


SMOLLM2 = Path(__file__).resolve().parents[1] / "examples" / "llm-repository" / "smollm2" / "1"


@pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(), reason="needs `make examples`")
def test_smollm2_summaries_with_prompt_lookup_equal_plain_greedy() -> None:
    """The real model: four summaries of a document, concurrently, greedy, with and
    without prompt lookup: the same tokens, and drafts kept."""
    sentences = (SMOLLM2.parents[3] / "examples" / "data" / "sentences.txt").read_text()
    doc = " ".join(sentences.splitlines()[:12])
    opts = {"kv_cache_bytes": 64 << 20, "max_model_len": 1024, "block_size": 8}
    params = SamplingParams(max_tokens=32, temperature=0.0)
    plain = engine(SMOLLM2, None, **opts)
    prompts = [
        plain.encode_messages([{"role": "user", "content": f"{doc}\n\nSummarize it{p}"}])
        for p in (".", "!", " briefly.", " in one line.")
    ]
    expected = run_all(plain, prompts, params)
    spec = engine(SMOLLM2, {"method": "prompt_lookup", "num_tokens": 6}, **opts)
    assert run_all(spec, prompts, params) == expected
    assert spec.metrics.accepted > 0
    assert spec.pool.num_used == 0


def test_the_documented_configuration_is_accepted() -> None:
    import yaml

    text = (Path(__file__).resolve().parents[1] / "docs" / "generative.md").read_text()
    section = text[text.index("## Speculative decoding") :]
    block = section[
        section.index("```yaml") + 7 : section.index("```", section.index("```yaml") + 7)
    ]
    doc = yaml.safe_load(block)
    options = LlmOptions.parse(doc["llm"], "config.yaml")
    spec = options.speculative
    assert spec is not None and spec.method == "prompt_lookup" and spec.num_tokens == 6
    assert (spec.ngram_min, spec.ngram_max, spec.max_batch) == (2, 4, 4)
