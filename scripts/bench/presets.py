"""The speculative configs the benchmarks compare, by name: plain vLLM, vLLM's
own methods, each of ours at its defaults, the recommended setting and the
cheap-draft variants."""

from __future__ import annotations

from pathlib import Path

from vllm_selfspec.assets import CONFIGS_DIR

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
# vLLM's Dynamic SD: a hand-written k per batch-size range, honoured by the
# V1 scheduler (`Scheduler.schedule`'s `num_spec_tokens_to_schedule`), so by
# the CPU runner too.
NGRAM_DYNAMIC = {**NGRAM, "num_speculative_tokens_per_batch_size":
                 [[1, 2, 4], [3, 8, 2], [9, 1024, 1]]}
SUFFIX = {"method": "suffix"}  # Arctic Inference's suffix trees, in vLLM


def del_heads(model: str) -> str | None:
    """DEL's shipped exit heads: <model>-del (dense shallow exits, where tokens
    per loaded layer can pay) if there are some, else AdaDecode's <model>."""
    for name in (f"{model}-del", model):
        if (CONFIGS_DIR / "heads" / name).exists():
            return name
    return None


def del_config(args) -> dict:
    """DEL with the model's trained heads if it has them, else its own LM head
    at the `--del-exits` layers (as for LayerSkip-style models)."""
    if heads := del_heads(args.model):
        return {"method": "del", "heads": heads}
    if args.del_exits:
        return {"method": "del", "exit_layers": args.del_exits}
    return {"method": "del", "exit_layer_stride": 2}


# The target as its own draft over its own weights and whole vocabulary, 4
# tokens every round (no exit threshold, no cost-aware budget, no lookups):
# what a full-depth draft costs (c) and how often a low-precision one agrees
# with the target.
FULL_DEPTH = {"method": "draft_verify", "num_speculative_tokens": 4,
              "adaptive_threshold": False, "threshold": 0.0, "cost_aware": False,
              "draft_precision": "target", "draft_vocab": "full", "lookup": False}


# A second plain engine under another name: how far two identical engines'
# speeds differ (engine start, compile, CPU state), the noise floor of every
# ratio here.
PLAIN_AGAIN = "plain_again"


def method_configs(model_dir: Path, args) -> dict[str, dict | None]:
    """Every setting the benchmark knows by name: the servers' (`settings_for`:
    each method at its defaults, nothing but its name) and the benchmark's own."""
    return {
        **settings_for(args.model),
        PLAIN_AGAIN: None,
        "draft_verify_full_depth": FULL_DEPTH,
        "draft_model_self": {"method": "draft_model", "model": str(model_dir),
                             "num_speculative_tokens": 4},
        **cheap_draft_configs(args),
    }


def recommended_config(model: str) -> dict:
    """The README's one short config: lookup drafts where the request's own
    text offers them, else the whole model as its own draft over an int8 copy of
    its weights and its draft vocabulary; cost-aware (the default)."""
    vocab = {"draft_vocab": model} if (CONFIGS_DIR / "vocab" / f"{model}.json").exists() else {}
    return {"method": "draft_verify", "draft_precision": "int8", **vocab, "lookup": {}}


def recommended_suffix_config(model: str) -> dict:
    """The recommended setting with its lookups from Arctic Inference's suffix
    trees (the request's text and past responses) instead of n-grams."""
    return {**recommended_config(model), "lookup": {"source": "suffix"}}


def cheap_draft_configs(args) -> dict[str, dict]:
    """The full-depth self-draft at each draft precision, with and without the
    model's draft vocabulary (int4 only where activations are bf16), and every
    method with int8 weights and the vocabulary but no lookups
    (`<method>_int8_vocab`)."""
    vocab = args.model if (CONFIGS_DIR / "vocab" / f"{args.model}.json").exists() else None
    precisions = ["target", "int8"] + (["int4"] if args.dtype == "bfloat16" else [])
    full_depth = FULL_DEPTH
    configs = {}
    for precision in precisions:
        for subset in ([None, vocab] if vocab else [None]):
            if precision == "target" and subset is None:
                continue  # draft_verify_full_depth
            name = f"full_depth_{precision}" + ("_vocab" if subset else "")
            configs[name] = {**full_depth, "draft_precision": precision,
                             **({"draft_vocab": subset} if subset else {})}
    cheap = {"draft_precision": "int8", "draft_vocab": vocab or "full", "lookup": False}
    for method in ("draft_verify", "adadecode", "del", "swift"):
        base = {"method": "draft_verify", "config_file": args.model} if (
            method == "draft_verify") else configs_for_method(method, args)
        if base is not None:
            configs[f"{method}_int8_vocab"] = {**base, **cheap}
    return configs


def configs_for_method(method: str, args) -> dict | None:
    if method == "adadecode":
        heads = CONFIGS_DIR / "heads" / args.model
        return {"method": "adadecode", "heads": args.model} if heads.exists() else None
    if method == "del":
        return del_config(args)
    return {"method": method}


def settings_for(model: str) -> dict[str, dict | None]:
    """The settings by name that the servers and the benchmark share
    (serve_sweep.py, load_test.py, `method_configs`); each method at its
    defaults (the shipped vocabulary and heads are found by the model's
    weights)."""
    return {
        "plain": None,
        "ngram": NGRAM,
        "ngram_dynamic": NGRAM_DYNAMIC,
        "suffix": SUFFIX,
        "recommended": recommended_config(model),
        "recommended_suffix": recommended_suffix_config(model),
        "draft_verify": {"method": "draft_verify"},
        "swift": {"method": "swift"},
        "del": {"method": "del"},
        "adadecode": {"method": "adadecode"},
    }
