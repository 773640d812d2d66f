"""Build a draft vocabulary for a model: the tokens it generates itself, ranked.

Plain vLLM decodes calibration prompts greedily (HumanEval, MT-bench and
GSM-style questions in the chat template, none of them a benchmark prompt);
tokens are ranked by how often the model emitted them (on-policy frequency),
then by how often they appeared in the prompts, then by id (BPE ids follow
merge order, roughly frequency). Coverage, the share of generated tokens
inside the top N, is measured on held-out prompts the ranking never saw; the
recommended size is the smallest power of two covering `--target-coverage`.

Writes runs/vocab/<model>.json (give its path as `draft_vocab`); `--install`
also puts it among the shipped vocabularies, where a method finds it by the
model's weights.

    python scripts/build_draft_vocab.py --model smollm2-135m   # runs/vocab/smollm2-135m.json
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

from vllm_selfspec import prompts as prompt_sets
from vllm_selfspec.assets import RESULTS_DIR, ROOT, fast_dtype
from vllm_selfspec.draft.heads import local_final_norm, model_identity
from vllm_selfspec.draft.vocab import save_vocab, vocab_dir

# Benchmarks use the first prompts of each set; calibration and held-out skip them.
CALIBRATION = {"humaneval": slice(64, 164), "mtbench": slice(40, 80), "gsm_seed": 7}
HELD_OUT = {"humaneval": slice(20, 40), "mtbench": slice(20, 40), "gsm_seed": 8}
MAX_RANKED = 32768
SIZES = (1024, 2048, 4096, 8192, 16384, 32768)


def prompt_set(tokenizer, spec: dict, gsm_count: int) -> list[str]:
    code = prompt_sets.humaneval(spec["humaneval"].stop)[spec["humaneval"]]
    chat = prompt_sets.mtbench(spec["mtbench"].stop)[spec["mtbench"]]
    math = prompt_sets.gsm_style(gsm_count, seed=spec["gsm_seed"])
    return prompt_sets.as_chat(tokenizer, code + chat + math)


def generate(llm, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.generate(prompts, params, use_tqdm=True)
    return ([list(o.prompt_token_ids) for o in outputs],
            [list(o.outputs[0].token_ids) for o in outputs])


def rank_tokens(generated: list[list[int]], prompts: list[list[int]],
                vocab_size: int) -> list[int]:
    """Generated frequency first, then prompt frequency, then id order."""
    out_counts = collections.Counter(t for seq in generated for t in seq)
    in_counts = collections.Counter(t for seq in prompts for t in seq)
    ranked = sorted(out_counts, key=lambda t: (-out_counts[t], t))
    seen = set(ranked)
    ranked += [t for t in sorted(in_counts, key=lambda t: (-in_counts[t], t))
               if t not in seen]
    seen = set(ranked)
    ranked += [t for t in range(vocab_size) if t not in seen]
    return ranked[:MAX_RANKED]


def coverage(ranked: list[int], generated: list[list[int]], size: int) -> float:
    kept = set(ranked[:size])
    tokens = [t for seq in generated for t in seq]
    return sum(t in kept for t in tokens) / max(len(tokens), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="name under models/")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--gsm", type=int, default=40, help="GSM-style prompts per set")
    parser.add_argument("--target-coverage", type=float, default=0.99)
    parser.add_argument("--dtype", default=fast_dtype())
    parser.add_argument("--out", type=Path, help="default: runs/vocab/<model>.json")
    parser.add_argument("--install", action="store_true",
                        help="also write it to vllm_selfspec/configs/vocab/<model>.json, "
                             "where methods find it by the model's weights")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from transformers import AutoConfig, AutoTokenizer
    from vllm import LLM

    model_dir = ROOT / "models" / args.model
    hf_config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    calibration = prompt_set(tokenizer, CALIBRATION, args.gsm)
    held_out = prompt_set(tokenizer, HELD_OUT, args.gsm // 2)
    llm = LLM(model=str(model_dir), dtype=args.dtype, max_model_len=2048, seed=0)
    prompt_ids, generated = generate(llm, calibration, args.max_tokens)
    _, held_out_generated = generate(llm, held_out, args.max_tokens)
    ranked = rank_tokens(generated, prompt_ids, hf_config.vocab_size)
    table = {size: round(coverage(ranked, held_out_generated, size), 4)
             for size in SIZES if size <= len(ranked)}
    size = next((s for s, c in table.items() if c >= args.target_coverage), max(table))
    out = args.out or RESULTS_DIR / "vocab" / f"{args.model}.json"
    identity = model_identity(hf_config, local_final_norm(str(model_dir)))
    command = "python scripts/build_draft_vocab.py " + " ".join(sys.argv[1:])
    for path in [out] + ([vocab_dir() / f"{args.model}.json"] if args.install else []):
        save_vocab(path, args.model, identity, ranked, size,
                   held_out_coverage=table, coverage_at_size=table[size],
                   distinct_generated=len(set(t for s in generated for t in s)),
                   calibration={"prompts": len(calibration), "tokens": sum(map(len, generated)),
                                "sets": {k: str(v) for k, v in CALIBRATION.items()}},
                   held_out={"prompts": len(held_out),
                             "tokens": sum(map(len, held_out_generated)),
                             "sets": {k: str(v) for k, v in HELD_OUT.items()}},
                   dtype=args.dtype, how_made=command.strip())
    print(f"{out}: size {size} of {hf_config.vocab_size}; held-out coverage {table}")


if __name__ == "__main__":
    main()
