"""Logprobs in the engine: each token's real bytes (a character split over tokens), the
prompt's logprobs (echo), entries only for text a stop string left in the answer, and a
partial character flushed at the end."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rtserve.runtime.llm.detok import Detokenizer, text_offsets  # noqa: E402
from rtserve.runtime.llm.engine import LlmEngine  # noqa: E402
from rtserve.runtime.llm.options import LlmOptions  # noqa: E402
from rtserve.runtime.llm.params import GenerationEvent, SamplingParams  # noqa: E402
from rtserve.runtime.llm.tokens import (  # noqa: E402
    BYTE_LEVEL,
    SENTENCEPIECE,
    TokenBytes,
    gpt2_bytes_of_chars,
)
from tests.llm_models import build_llm, build_tokenizer, run_all  # noqa: E402

EMOJI = "the cat 😀 sat é"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module")
def version_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llm(tmp_path_factory.mktemp("llm"), name="tiny", arch="llama")


def engine(version_dir: Path, **options: object) -> LlmEngine:
    opts = {"device": "cpu", "kv_cache_bytes": 8 << 20, "max_model_len": 256, "threads": 1}
    opts.update(options)
    e = LlmEngine("tiny", "1", version_dir, LlmOptions.parse(opts, "test"))
    e.start()
    return e


def events(
    e: LlmEngine, prompts: list[list[int]], params: SamplingParams, **kw: Any
) -> list[list[GenerationEvent]]:
    """Every prompt's events, run at once; the engine stopped after."""
    return run_all(e, prompts, params, **kw)  # type: ignore[no-any-return]


def test_gpt2_table_maps_each_byte_from_one_printable_character() -> None:
    table = gpt2_bytes_of_chars()
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == 0x20 and table["Ċ"] == 0x0A and table["A"] == 0x41
    assert all(c.isprintable() and not c.isspace() for c in table)


def test_byte_level_tokens_give_the_bytes_of_a_split_character(tokenizer: Any) -> None:
    texts = TokenBytes(tokenizer)
    assert texts.kind == BYTE_LEVEL
    ids = tokenizer.encode(EMOJI)
    pieces = [texts(i) for i in ids]
    assert b"".join(raw for _, raw in pieces) == EMOJI.encode()
    assert any(text == "\ufffd" for text, _ in pieces)  # the emoji is split over byte tokens
    assert all(text == raw.decode("utf-8", "replace") for text, raw in pieces)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert texts(end) == ("<|im_end|>", b"<|im_end|>")  # a special token is its text


def test_sentencepiece_byte_pieces_and_word_starts() -> None:
    class SentencePieceLike:
        sp_model = object()
        all_special_ids = [1]
        pieces = {1: "<s>", 5: "\u2581cat", 6: "<0xF0>", 7: "<0x9F>", 8: "s"}

        def convert_ids_to_tokens(self, i: int) -> str:
            return self.pieces[i]

        def decode(self, ids: list[int]) -> str:
            return "".join(self.pieces[i] for i in ids)

    texts = TokenBytes(SentencePieceLike())
    assert texts.kind == SENTENCEPIECE
    assert texts(5) == (" cat", b" cat")
    assert texts(6) == ("\ufffd", b"\xf0") and texts(7)[1] == b"\x9f"
    assert texts(1) == ("<s>", b"<s>")


def test_a_partial_character_is_flushed_at_the_end_unless_a_stop_string_cut(
    tokenizer: Any,
) -> None:
    ids = tokenizer.encode("a 😀")
    detok = Detokenizer(tokenizer, ())
    for token in ids[:-1]:  # the emoji's last byte never comes
        detok.add(token)
    held = detok.delta(final=False)
    assert held + detok.delta(final=True) == "a \ufffd"  # what was held, not dropped
    detok = Detokenizer(tokenizer, ("a",))
    for token in ids[:-1]:
        if detok.add(token):
            break
    assert detok.stopped and detok.delta(final=True) == ""


def test_text_offsets_place_a_split_character_at_its_start(tokenizer: Any) -> None:
    ids = tokenizer.encode(EMOJI)
    offsets = text_offsets(tokenizer, ids)
    texts = TokenBytes(tokenizer)
    assert offsets[0] == 0 and offsets == sorted(offsets)
    for i, offset in zip(ids, offsets, strict=True):
        text = texts(i)[0]
        if "\ufffd" not in text:
            assert EMOJI[offset : offset + len(text)] == text
    split = [o for i, o in zip(ids, offsets, strict=True) if texts(i)[0] == "\ufffd"]
    assert split and {EMOJI[o] for o in split} == {"😀", "é"}  # where the character starts


def _reference_logprobs(version_dir: Path, ids: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(version_dir)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [float(lp[j - 1, ids[j]]) for j in range(1, len(ids))]


def test_prompt_logprobs_over_chunks_equal_transformers_and_skip_the_prefix_cache(
    version_dir: Path,
) -> None:
    """A 60-token prompt prefilled in 16-token chunks, once cached by a plain request: each
    prompt token's logprob as transformers gives it, the first null, offsets in its text."""
    e = engine(version_dir, block_size=4, max_num_batched_tokens=16)
    ids = e.encode_text("the cat sat on a warm mat while rain fell outside " * 6)[:60]
    assert len(ids) == 60
    plain = SamplingParams(max_tokens=2, temperature=0.0, logprobs=2)

    async def go() -> tuple[list[GenerationEvent], list[GenerationEvent]]:
        try:
            first = [ev async for ev in e.generate(ids, plain)]
            scored = [ev async for ev in e.generate(ids, plain, prompt_logprobs=True)]
            return first, scored
        finally:
            await e.stop()

    first, scored = asyncio.run(go())
    assert all(ev.prompt_logprobs is None for ev in first)  # not asked: nothing computed
    assert first[0].cached_tokens == 0 and scored[0].cached_tokens == 0
    lps = scored[0].prompt_logprobs
    assert lps is not None and all(ev.prompt_logprobs is None for ev in scored[1:])
    assert len(lps) == 60 and lps[0].logprob is None and lps[0].top == []
    got = [lp.logprob for lp in lps[1:]]
    assert got == pytest.approx(_reference_logprobs(version_dir, ids), abs=2e-4)
    assert all(len(lp.top) == 2 for lp in lps[1:])
    text = e.tokenizer.decode(ids, skip_special_tokens=True)
    assert [lp.offset for lp in lps] == text_offsets(e.tokenizer, ids)
    assert all(text[lp.offset : lp.offset + len(lp.token)] == lp.token for lp in lps)
    # (the answer is the same either way)
    assert [ev.token_ids for ev in scored] == [ev.token_ids for ev in first]


def test_logprobs_only_for_tokens_a_stop_string_left_in_the_answer(
    version_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = engine(version_dir)
    script = e.tokenizer.encode(" the cat sat on the mat", add_special_tokens=False)
    scripted(monkeypatch, script)
    stop = "t on"  # (begins inside " sat": that token is partly in the answer)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0, stop=(stop,))
    (cut,) = events(e, [e.encode_text("the cat")], params)
    text = "".join(ev.text for ev in cut)
    assert text == " the cat sa" and cut[-1].finish_reason == "stop"
    sent = []
    emitted = 0
    for ev in cut:  # no event carries the logprob of text not yet handed out
        emitted += len(ev.text)
        sent += ev.logprobs or []
        assert all(lp.offset < emitted for lp in ev.logprobs or [])
    assert "".join(lp.token for lp in sent) == " the cat sat"
    assert sum(len(ev.token_ids) for ev in cut) > len(sent)  # " on" was made, and cut


def scripted(monkeypatch: pytest.MonkeyPatch, script: list[int]) -> None:
    """The engine's next tokens are ``script``'s (one sequence at a time)."""
    import rtserve.runtime.llm.engine as engine_module

    made: list[int] = []

    def sample(logits: Any, params: list[SamplingParams], generators: list[Any]) -> list[int]:
        made.append(script[len(made)])
        return [made[-1]]

    monkeypatch.setattr(engine_module, "sample", sample)


def test_a_partial_character_at_length_is_flushed_with_its_logprob(
    version_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The answer ends (max_tokens) inside a character split over byte tokens: the text
    keeps what was held (its space, the part as U+FFFD), and each token's logprob comes."""
    e = engine(version_dir)
    script = e.tokenizer.encode(" ok 😀", add_special_tokens=False)[:-1]  # (the last byte cut)
    assert len(script) >= 3
    scripted(monkeypatch, script)
    params = SamplingParams(max_tokens=len(script), temperature=0.0, logprobs=0)
    (out,) = events(e, [e.encode_text("the cat")], params)
    text = "".join(ev.text for ev in out)
    assert out[-1].finish_reason == "length" and text == " ok \ufffd"
    lps = [lp for ev in out for lp in ev.logprobs or []]
    assert len(lps) == len(script)
    assert b"".join(lp.raw or b"" for lp in lps) == " ok 😀".encode()[:-1]
    assert lps[-1].offset == len(" ok ")


def test_prompt_logprobs_survive_preemption(version_dir: Path) -> None:
    """Many scored prompts in a small pool: sequences are preempted and recomputed, and
    each prompt's logprobs are still transformers', once each."""
    e = engine(version_dir, block_size=4, kv_cache_bytes=80 << 10, max_num_batched_tokens=32)
    words = ["the", "cat", "sat", "on", "a", "warm", "mat", "while", "rain", "fell", "outside"]
    prompts = [e.encode_text(" ".join(words[: 3 + i % 8] * 3)) for i in range(12)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    out = events(e, prompts, params, prompt_logprobs=True)
    assert e.scheduler.preemptions > 0
    for ids, evs in zip(prompts, out, strict=True):
        scored = [ev.prompt_logprobs for ev in evs if ev.prompt_logprobs is not None]
        assert len(scored) == 1 and len(scored[0]) == len(ids)
        got = [lp.logprob for lp in scored[0][1:]]
        assert got == pytest.approx(_reference_logprobs(version_dir, ids), abs=2e-4)
