"""Small generative models for tests: random weights from a transformers config, with a
byte-level BPE tokenizer trained in-process on the example sentences and a chat template.
Built in well under a second; saved as a Hugging Face directory (``backend: llm``)."""

from __future__ import annotations

from pathlib import Path

import yaml

SENTENCES = Path(__file__).resolve().parents[1] / "examples" / "data" / "sentences.txt"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(vocab_size: int = 400):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = SENTENCES.read_text().splitlines() * 2
    tok.train_from_iterator(lines, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_llm(
    root: Path,
    name: str = "tiny",
    arch: str = "llama",
    llm: dict | None = None,
    slo: dict | None = None,
    seed: int = 0,
    layers: int = 2,
    hidden: int = 64,
    extra: dict | None = None,
) -> Path:
    """``root/name/1/`` with a random ``arch`` (llama | qwen2 | gpt2 | mistral | gemma2 |
    bloom) model, its tokenizer and ``root/name/config.yaml``; ``extra``: more config
    fields (a sliding window, soft-capping); returns the version directory."""
    import torch
    import transformers

    tokenizer = build_tokenizer()
    vocab = len(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    bos = tokenizer.convert_tokens_to_ids("<|im_start|>")
    common = dict(vocab_size=vocab, bos_token_id=bos, eos_token_id=eos)
    common.update(extra or {})
    if arch == "gpt2":
        config = transformers.GPT2Config(
            n_layer=layers, n_embd=hidden, n_head=4, n_positions=1024, **common
        )
    elif arch == "bloom":
        config = transformers.BloomConfig(n_layer=layers, hidden_size=hidden, n_head=4, **common)
    else:
        cls = {
            "llama": transformers.LlamaConfig,
            "qwen2": transformers.Qwen2Config,
            "mistral": transformers.MistralConfig,
            "gemma2": transformers.Gemma2Config,
        }[arch]
        config = cls(
            num_hidden_layers=layers,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=hidden // 4,
            max_position_embeddings=1024,
            tie_word_embeddings=True,
            **common,
        )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # larger logits: fewer near-ties between batched and single runs
        model.get_output_embeddings().weight.mul_(8.0)
    version_dir = root / name / "1"
    model.save_pretrained(version_dir)
    tokenizer.save_pretrained(version_dir)
    section = {"device": "cpu", "kv_cache_bytes": 8 << 20, "max_model_len": 512, "threads": 1}
    section.update(llm or {})
    cfg: dict = {"backend": "llm", "llm": section}
    if slo:
        cfg["slo"] = slo
    (root / name / "config.yaml").write_text(yaml.safe_dump(cfg))
    return version_dir


def start_engine(version_dir: Path, **options: object):  # type: ignore[no-untyped-def]
    """A started ``LlmEngine`` on the CPU (small pool, one thread unless ``options`` say)."""
    from rtserve.runtime.llm.engine import LlmEngine
    from rtserve.runtime.llm.options import LlmOptions

    opts: dict = {"device": "cpu", "kv_cache_bytes": 8 << 20, "max_model_len": 512, "threads": 1}
    opts.update(options)
    e = LlmEngine("tiny", "1", version_dir, LlmOptions.parse(opts, "test"))
    e.start()
    return e


def run_all(e, prompts: list[list[int]], params, **kw):  # type: ignore[no-untyped-def]
    """Every prompt's events (``e.generate(ids, params, **kw)``), all prompts at once; then
    the engine stops."""
    import asyncio

    async def one(ids: list[int]) -> list:  # type: ignore[type-arg]
        return [event async for event in e.generate(ids, params, **kw)]

    async def all_at_once() -> list:  # type: ignore[type-arg]
        try:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        finally:
            await e.stop()

    return asyncio.run(all_at_once())


def generate_greedy(e, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Every prompt's greedy tokens (``ignore_eos``), all at once; then the engine stops."""
    from rtserve.runtime.llm.params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [
        [t for event in events for t in event.token_ids] for events in run_all(e, prompts, params)
    ]
