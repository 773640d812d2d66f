"""The benchmark's requests: named prompt sets, taking turns request by request."""

from __future__ import annotations

import argparse

from vllm_selfspec import prompts as prompt_sets


# `--prompt-set` names these, each `--num-prompts` requests; "every" is all
# kinds in one run, requests of each kind in turn.
PROMPT_SETS = {
    "mixed": prompt_sets.code_then_chat,
    "humaneval": prompt_sets.humaneval,
    "mtbench": prompt_sets.mtbench,
    "gsm": prompt_sets.gsm_style,
    "copy": prompt_sets.copy_heavy,
}


EVERY_SET = ("humaneval", "mtbench", "gsm", "copy")


def prompt_set_names(value: str) -> list[str]:
    """`--prompt-set`'s value: one set, a comma-separated list, or "every"."""
    names = list(EVERY_SET) if value == "every" else value.split(",")
    unknown = [name for name in names if name not in PROMPT_SETS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown prompt set {', '.join(unknown)}: choose from "
            f"{', '.join(PROMPT_SETS)} or every")
    return names


def benchmark_requests(num_prompts: int, sets: list[str]) -> list[tuple[str, str]]:
    """(set, question) for `num_prompts` questions of each set, the sets taking
    turns request by request (so that no set runs only on a fresh engine, or
    only after another set has shaped the drafter's records)."""
    questions = [PROMPT_SETS[name](num_prompts) for name in sets]
    return [(sets[index], question) for group in zip(*questions)
            for index, question in enumerate(group)]


def benchmark_prompts(tokenizer, num_prompts: int, sets: list[str] = ("mixed",)) -> list[str]:
    """The benchmark's prompts in the model's chat template: by default half
    HumanEval, half MT-bench ("mixed")."""
    return prompt_sets.as_chat(tokenizer, [question for _, question in
                                           benchmark_requests(num_prompts, list(sets))])
