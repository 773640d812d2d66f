"""Bad speculative configs fail at start-up with a sentence naming the field."""

from __future__ import annotations

import json

import pytest
from vllm.engine.arg_utils import EngineArgs

from vllm_selfspec.config import CONFIGS_DIR
from vllm_selfspec.proposers.draft_verify import DraftVerifyConfig


def engine_config(model, speculative_config, **kwargs):
    kwargs.setdefault("dtype", "float32")
    args = EngineArgs(model=str(model), max_model_len=512, block_size=32,
                      speculative_config=speculative_config, **kwargs)
    return args.create_engine_config()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"method": "dell"}, r"speculative_config\.method: unknown method 'dell'"),
        ({"method": "draft_verify", "attn_skipp": [1]},
         r"unknown key\(s\) \['attn_skipp'\]"),
        ({"method": "draft_verify", "attn_skip": [3, 30]},
         r"speculative_config\.attn_skip: layer indices \[30\] are out of range"),
        ({"method": "draft_verify", "mlp_skip": [-1]},
         r"speculative_config\.mlp_skip: layer indices \[-1\]"),
        ({"method": "draft_verify", "attn_skip": list(range(30)),
          "mlp_skip": list(range(30))}, r"every sub-block is skipped"),
        ({"method": "draft_verify", "threshold": 1.5},
         r"speculative_config\.threshold: 1\.5 is outside \[0, 1\]"),
        ({"method": "draft_verify", "model": "other"},
         r"speculative_config\.model: method 'draft_verify' drafts with the target"),
        ({"method": "draft_verify", "config_file": "no-such-file"},
         r"speculative_config\.config_file: no file 'no-such-file'"),
        ({"method": "del", "draft_precision": "fp3"},
         r"speculative_config\.draft_precision: 'fp3' is not supported; use one of"),
        ({"method": "adadecode", "heads": "smollm2-135m", "draft_precision": "bf16"},
         r"draft_precision: 'bf16' drafts with the target's own bf16 weights, but the "
         r"target runs in torch\.float32"),
        ({"method": "swift", "draft_precision": "int4"},
         r"draft_precision: 'int4' \(W4A16\) needs bf16 or fp16 activations"),
        ({"method": "draft_verify", "draft_vocab": "nope"},
         r"speculative_config\.draft_vocab: no file 'nope'"),
        ({"method": "draft_verify", "draft_vocab": 10**6},
         r"speculative_config\.draft_vocab_size: 1000000 is outside 1\.\.32768"),
        ({"method": "draft_verify", "draft_vocab_size": 100},
         r"speculative_config\.draft_vocab_size: needs draft_vocab"),
        ({"method": "draft_verify", "lookup": {"max_tokens": 0}},
         r"speculative_config\.lookup: max_tokens 0 must be >= 1"),
        ({"method": "draft_verify", "lookup": {"min": 2}},
         r"speculative_config\.lookup: unknown key\(s\) \['min'\]"),
    ],
)
def test_bad_config_fails_naming_the_field(model_dir, spec, message):
    with pytest.raises(ValueError, match=message):
        engine_config(model_dir, spec)


def test_unsupported_architecture(gpt2_dir):
    with pytest.raises(ValueError, match=r"cannot run the layers of architecture "
                                         r"\['GPT2LMHeadModel'\]"):
        engine_config(gpt2_dir, {"method": "draft_verify"})


def test_pipeline_parallel_refused(model_dir):
    with pytest.raises(ValueError, match=r"pipeline_parallel_size: .* needs "
                                         r"pipeline_parallel_size=1"):
        engine_config(model_dir, {"method": "draft_verify"}, pipeline_parallel_size=2)


def test_valid_config_gets_defaults_and_lookahead(model_dir):
    config = engine_config(model_dir, {"method": "draft_verify", "attn_skip": [4]})
    spec = config.speculative_config
    assert isinstance(spec, DraftVerifyConfig)
    assert spec.num_speculative_tokens == 12  # Draft & Verify's K
    assert (spec.threshold, spec.target_acceptance) == (0.6, 0.9)
    assert spec.attn_skip == [4] and spec.mlp_skip == []
    # vLLM reserves a KV slot per draft token for draft KV.
    assert config.num_lookahead_tokens == 12


def test_config_file_fills_unset_keys(model_dir, tmp_path):
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"methods": {"draft_verify": {
        "attn_skip": [5, 6], "mlp_skip": [7], "num_speculative_tokens": 5}}}))
    spec = engine_config(model_dir, {"method": "draft_verify", "config_file": str(path),
                                     "mlp_skip": [9]}).speculative_config
    assert spec.attn_skip == [5, 6]  # from the file
    assert spec.mlp_skip == [9]  # explicit beats the file
    assert spec.num_speculative_tokens == 5


def test_config_file_with_bad_values_is_refused(model_dir, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"methods": {"draft_verify": {"attn_skip": "x"}}}))
    with pytest.raises(ValueError, match=r"key 'attn_skip' is invalid"):
        engine_config(model_dir, {"method": "draft_verify", "config_file": str(path)})


def test_skip_set_enters_the_compile_hash(model_dir):
    first = engine_config(model_dir, {"method": "draft_verify", "attn_skip": [4]})
    second = engine_config(model_dir, {"method": "draft_verify", "attn_skip": [5]})
    assert first.compute_hash() != second.compute_hash()


def test_draft_vocab_size_takes_the_models_shipped_vocabulary(model_dir):
    spec = engine_config(model_dir, {"method": "draft_verify", "draft_vocab": 4096,
                                     "draft_precision": "int8"}).speculative_config
    assert spec.draft_vocab.endswith("vllm_selfspec/configs/vocab/smollm2-135m.json")
    assert spec.draft_vocab_size == 4096 and len(spec.draft_vocab_token_ids()) == 4096
    other = engine_config(model_dir, {"method": "draft_verify", "draft_vocab": 8192,
                                      "draft_precision": "int8"})
    assert other.compute_hash() != engine_config(
        model_dir, {"method": "draft_verify", "draft_vocab": 4096,
                    "draft_precision": "int8"}).compute_hash()


def test_draft_vocab_of_another_model_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"draft_vocab: .*smollm2-135m.json was made for "
                                         r"smollm2-135m, whose weights differ"):
        engine_config(tiny_llama_dir, {"method": "draft_verify",
                                       "draft_vocab": "smollm2-135m"})


def test_int4_on_a_shape_its_kernels_cannot_tile_is_refused(tiny_llama_dir):
    """The random Llama's hidden size 128 tiles, its 2 heads x 64 too; an
    intermediate size of 256 / 2 ranks does as well, so make one that does not."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(tiny_llama_dir)
    config.hidden_size = 96
    config.save_pretrained(tiny_llama_dir.parent / "odd-llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tiny_llama_dir.parent / "odd-llama" / name).write_bytes(
            (tiny_llama_dir / name).read_bytes())
    with pytest.raises(ValueError, match=r"draft_precision: 'int4' cannot run this model's "
                                         r"layers \(input size 96 is not a multiple of 64\)"):
        engine_config(tiny_llama_dir.parent / "odd-llama",
                      {"method": "draft_verify", "draft_precision": "int4"},
                      dtype="bfloat16")


def test_vanilla_methods_untouched(model_dir):
    config = engine_config(model_dir, {"method": "ngram", "num_speculative_tokens": 3,
                                       "prompt_lookup_max": 2})
    assert type(config.speculative_config).__name__ == "SpeculativeConfig"


@pytest.mark.parametrize("name", sorted(
    path.name for path in (CONFIGS_DIR / "heads").iterdir() if path.is_dir()))
def test_shipped_heads_are_whole_for_the_model_they_name(name):
    """Every heads directory under vllm_selfspec/configs/heads/ holds a d x d transform per
    exit layer for the model its heads.json names (shapes and layers checked
    as at start-up; the weights' identity needs the model, checked then)."""
    from types import SimpleNamespace

    from vllm_selfspec.workers.exit_heads import ExitHeads

    heads = ExitHeads.open(str(CONFIGS_DIR / "heads" / name))
    heads.check_shapes(SimpleNamespace(**heads.meta["model"]))
    assert heads.exit_layers == sorted(set(heads.exit_layers))
    assert heads.meta["model"]["name"] in name


@pytest.mark.parametrize("key, value", [
    ("quantization", "fp8"), ("revision", "main"), ("draft_tensor_parallel_size", 1),
    ("enforce_eager", True), ("prompt_lookup_max", 4),
    ("num_speculative_tokens_per_batch_size", [[1, 4, 2]])])
def test_vllm_keys_a_method_does_not_implement_are_refused(model_dir, key, value):
    with pytest.raises(ValueError, match=rf"speculative_config: vLLM key\(s\) \['{key}'\] "
                                         r"do nothing for method 'draft_verify'"):
        engine_config(model_dir, {"method": "draft_verify", key: value})


@pytest.mark.parametrize("rejection", ["synthetic", "block"])
def test_verification_other_than_the_standard_rejection_sampler_is_refused(model_dir,
                                                                          rejection):
    spec = {"method": "swift", "rejection_sample_method": rejection}
    if rejection == "synthetic":
        spec["synthetic_acceptance_rates"] = [0.9]
    with pytest.raises(ValueError, match=r"speculative_config(\.rejection_sample_method|: "
                                         r"vLLM key)"):
        engine_config(model_dir, spec)


def test_draft_sampling_defaults_to_probabilistic_and_greedy_is_kept(model_dir):
    assert engine_config(model_dir, {"method": "del"}).speculative_config \
        .draft_sample_method == "probabilistic"
    config = engine_config(model_dir, {"method": "draft_verify", "draft_sample_method": "greedy",
                                       "rejection_sample_method": "standard"})
    assert config.speculative_config.draft_sample_method == "greedy"
    with pytest.raises(ValueError, match=r"draft_sample_method: use one of"):
        engine_config(model_dir, {"method": "draft_verify", "draft_sample_method": "top_k"})
