"""What a suffix tree's estimate tells of a draft's acceptance.

Plain vLLM answers mixed prompts greedily; Arctic Inference's
`SuffixDecodingCache` is then replayed over the answers as a server would feed
it (one request after another, each answer joining the cache of past
responses), and at every output position the trees' draft is checked against
the greedy continuation. Printed, and written to
`results/suffix-calibration-<model>.json`: first-token and per-token
acceptance by the match's length and the trees' first estimate p_1, and the
acceptance of a token after an accepted one by how far the estimate fell
between them (p_i / p_(i-1): where the trees' continuations branched).

    python scripts/lab/suffix_calibration.py --model smollm2-135m --num-prompts 24
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import numpy as np

from vllm_selfspec import prompts as prompt_sets
from vllm_selfspec.assets import ROOT
from vllm_selfspec.config import LOOKUP_DEFAULTS

sys.path.insert(0, str(ROOT / "scripts"))
from bench.provenance import provenance  # noqa: E402

MAX_TREE_DEPTH = LOOKUP_DEFAULTS["max_tree_depth"]  # the suffix lookup's defaults


def greedy_answers(model: str, num_prompts: int, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(chat-templated prompt tokens, greedy answer tokens) per mixed prompt."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(ROOT / "models" / model), dtype="float32", max_model_len=2048, seed=0)
    prompts = prompt_sets.as_chat(llm.get_tokenizer(), prompt_sets.mixed(num_prompts))
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                   ignore_eos=True))
    return [(list(output.prompt_token_ids), list(output.outputs[0].token_ids))
            for output in outputs]


def replay(answers: list[tuple[list[int], list[int]]]) -> list[dict]:
    """The trees' draft at every output position, with its match length, path
    probabilities and how many of its tokens the greedy answer accepts."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    cache = SuffixDecodingCache(max_tree_depth=MAX_TREE_DEPTH,
                                max_cached_requests=LOOKUP_DEFAULTS["max_cached_requests"])
    drafts = []
    for index, (prompt, answer) in enumerate(answers):
        req_id = f"request-{index}"
        cache.start_request(req_id, np.asarray(prompt, dtype=np.int32))
        context = list(prompt)
        for position, token in enumerate(answer):
            draft = cache.speculate(req_id, np.asarray(context[-MAX_TREE_DEPTH:], dtype=np.int32),
                                    max_spec_tokens=LOOKUP_DEFAULTS["max_tokens"],
                                    max_spec_factor=LOOKUP_DEFAULTS["max_spec_factor"],
                                    min_token_prob=LOOKUP_DEFAULTS["min_token_prob"])
            if draft.token_ids:
                accepted = 0
                for drafted, actual in zip(draft.token_ids, answer[position:]):
                    if drafted != actual:
                        break
                    accepted += 1
                drafts.append({"match_length": draft.match_len, "probabilities": list(draft.probs),
                               "accepted": accepted})
            cache.add_active_response(req_id, np.asarray([token], dtype=np.int32))
            context.append(token)
        cache.stop_request(req_id)
    return drafts


def match_band(length: int) -> str:
    return "1" if length <= 1 else "2" if length == 2 else "3-4" if length <= 4 \
        else "5-8" if length <= 8 else "9+"


def estimate_band(probability: float) -> str:
    return "<0.4" if probability < 0.4 else "0.4-0.6" if probability < 0.6 \
        else "0.6-0.9" if probability < 0.9 else ">=0.9"


def tabulate(drafts: list[dict]) -> dict:
    by_match: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    after_fall: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for draft in drafts:
        probabilities, accepted = draft["probabilities"], draft["accepted"]
        counts = by_match[(match_band(draft["match_length"]), estimate_band(probabilities[0]))]
        counts[0] += 1
        counts[1] += accepted > 0
        counts[2] += accepted
        counts[3] += accepted < len(probabilities)
        for i in range(1, min(len(probabilities), accepted + 1)):
            fall = after_fall[estimate_band(probabilities[i] / probabilities[i - 1])]
            fall[0] += 1
            fall[1] += accepted > i
    return {
        "by_match_length_and_first_estimate": [
            {"match_length": match, "first_estimate": estimate, "drafts": n,
             "first_token_acceptance": round(first / n, 3),
             "per_token_acceptance": round(tokens / max(tokens + rejections, 1), 3)}
            for (match, estimate), (n, first, tokens, rejections) in sorted(by_match.items())],
        "after_an_accepted_token_by_estimate_fall": [
            {"fall": fall, "tokens": n, "acceptance": round(accepted / n, 3)}
            for fall, (n, accepted) in sorted(after_fall.items())],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="name under models/")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    table = tabulate(replay(greedy_answers(args.model, args.num_prompts, args.max_tokens)))
    for row in table["by_match_length_and_first_estimate"]:
        print(row)
    for row in table["after_an_accepted_token_by_estimate_fall"]:
        print(row)
    path = ROOT / "results" / f"suffix-calibration-{args.model}.json"
    path.write_text(json.dumps({**provenance(), "argv": vars(args),
                                **table}, indent=1) + "\n")
    print(f"saved {path}")


if __name__ == "__main__":
    main()
