"""transformers' static-batch ``generate`` in-process: the no-server reference for tokens/s.

Run as a subprocess by ``bench.generative`` (so its threads are gone before a server starts):
``python -m bench.hf_generate MODEL_DIR --batches 1,8,32 --max-tokens 128 --threads 1`` prints one JSON
line per batch: ``{"batch": b, "seconds": s, "tokens": n, "tok_s": n / s}``.
"""

from __future__ import annotations

import argparse
import time

import orjson

from bench.generative import story


def run(model_dir: str, batches: list[int], max_tokens: int, threads: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def generate(batch: int) -> tuple[float, int]:
        texts = [
            tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
            for m in map(story, range(batch))
        ]
        enc = tokenizer(texts, return_tensors="pt", padding=True)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        seconds = time.perf_counter() - start
        return seconds, int(out.shape[0] * (out.shape[1] - enc["input_ids"].shape[1]))

    generate(1)
    for batch in batches:
        seconds, tokens = generate(batch)
        line = {"batch": batch, "seconds": seconds, "tokens": tokens, "tok_s": tokens / seconds}
        print(orjson.dumps(line).decode(), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    run(args.model_dir, batches, args.max_tokens, args.threads)


if __name__ == "__main__":
    main()
