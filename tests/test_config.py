"""Bad speculative configs fail at start-up with a sentence naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm.engine.arg_utils import EngineArgs

from vllm_selfspec.assets import CONFIGS_DIR
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
        ({"method": "draft_verify", "defaults": {}},  # a class attribute, not a key
         r"unknown key\(s\) \['defaults'\]"),
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
        ({"method": "adadecode", "heads": "none"},
         r"speculative_config\.heads: adadecode needs trained exit heads, not 'none'; "
         r"train them with `python scripts/train_exit_heads\.py"),
        ({"method": "swift", "draft_precision": "int4"},
         r"draft_precision: 'int4' \(W4A16\) needs bf16 or fp16 activations"),
        ({"method": "draft_verify", "draft_vocab": "nope"},
         r"speculative_config\.draft_vocab: no file 'nope'"),
        ({"method": "draft_verify", "draft_vocab": 10**6},
         r"speculative_config\.draft_vocab_size: 1000000 is outside 1\.\.32768"),
        ({"method": "draft_verify", "draft_vocab": "full", "draft_vocab_size": 100},
         r"speculative_config\.draft_vocab_size: draft_vocab 'full' keeps every token"),
        ({"method": "draft_verify", "lookup": {"max_tokens": 0}},
         r"speculative_config\.lookup\.max_tokens: 0 must be >= 1; the default is 12\."),
        ({"method": "draft_verify", "lookup": {"min": 2}},
         r"speculative_config\.lookup: unknown key\(s\) \['min'\]"),
        ({"method": "draft_verify", "lookup": {"source": "trie"}},
         r"speculative_config\.lookup: source 'trie' is not one of \['ngram', 'suffix'\]"),
        ({"method": "draft_verify", "lookup": {"source": "suffix", "min_token_prob": 2}},
         r"speculative_config\.lookup\.min_token_prob: 2 is outside \[0, 1\]"),
        ({"method": "draft_verify", "lookup": {"max_cached_requests": -1}},
         r"speculative_config\.lookup\.max_cached_requests: -1 must be >= 0"),
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


@pytest.mark.parametrize(("keys", "round_length"), [
    ({}, 12),  # the full-depth base's rounds: draft_verify's K
    ({"full_depth": False}, 5),  # every draft a head's: at most max_early
    ({"full_depth": False, "num_speculative_tokens": 3}, 3),
    ({"full_depth": False, "max_early": 8}, 8)])
def test_adadecodes_round_is_its_bases_or_at_most_max_early_without_one(model_dir, keys,
                                                                         round_length):
    config = engine_config(model_dir, {"method": "adadecode", **keys})
    assert config.speculative_config.num_speculative_tokens == round_length
    assert config.num_lookahead_tokens == round_length


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


@pytest.mark.parametrize("method", ["draft_verify", "swift", "del", "adadecode"])
def test_a_method_by_its_name_gets_the_cheap_draft_and_the_shipped_assets(model_dir,
                                                                          method):
    """Nothing but `method`: an int8 copy (on a CPU), the model's shipped
    vocabulary and heads found by its weights, lookups first."""
    from vllm_selfspec.config import LOOKUP_DEFAULTS

    spec = engine_config(model_dir, {"method": method}).speculative_config
    assert spec.draft_precision == "int8"
    assert spec.draft_vocab == str(CONFIGS_DIR / "vocab" / "smollm2-135m.json")
    assert spec.draft_vocab_size == json.loads(Path(spec.draft_vocab).read_text())["size"]
    assert spec.lookup == LOOKUP_DEFAULTS
    shipped_heads = {"del": "smollm2-135m-del", "adadecode": "smollm2-135m"}
    if method in shipped_heads:
        assert spec.heads == str(CONFIGS_DIR / "heads" / shipped_heads[method])
        assert spec.exit_layers == json.loads(
            (Path(spec.heads) / "heads.json").read_text())["exit_layers"]


def test_every_part_of_the_default_draft_switches_off(model_dir):
    spec = engine_config(model_dir, {
        "method": "del", "draft_precision": "target", "draft_vocab": "full",
        "lookup": False, "heads": "none"}).speculative_config
    assert (spec.draft_precision, spec.draft_vocab, spec.lookup) == ("target", "full", False)
    assert spec.trained_heads is None and spec.draft_vocab_token_ids() is None
    assert spec.exit_layers == list(range(1, 30))  # the model's own head at every exit
    assert engine_config(model_dir, {"method": "del", "exit_layers": [8, 16]}
                         ).speculative_config.trained_heads is None  # exits by layer


def test_a_model_without_shipped_assets_drafts_over_its_whole_vocabulary(tiny_llama_dir):
    spec = engine_config(tiny_llama_dir, {"method": "draft_verify"}).speculative_config
    assert spec.draft_vocab == "full" and spec.draft_vocab_token_ids() is None
    with pytest.raises(ValueError, match=r"speculative_config\.heads: no exit heads are "
                                         r"shipped for this model and adadecode needs "
                                         r"them; train them with `python "
                                         r"scripts/train_exit_heads\.py --model MODEL_DIR`"):
        engine_config(tiny_llama_dir, {"method": "adadecode"})


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

    from vllm_selfspec.draft.heads import ExitHeads

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


def test_the_settings_tables_are_written_from_the_config_classes():
    """docs/settings.md and the README state each setting as its config field
    does (`scripts/settings_doc.py` writes them)."""
    import subprocess
    import sys

    from vllm_selfspec.assets import ROOT

    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "settings_doc.py"),
                             "--check"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.engine_free
@pytest.mark.parametrize("method", ["draft_verify", "swift", "del", "adadecode"])
def test_each_setting_states_its_default_and_range_once(method):
    """A field's `Option` is where its default and range live: each default
    lies inside its range, a value past either bound fails naming the field,
    and the defaults a config applies are exactly the Options' (the settings
    tables are written from the same, `scripts/settings_doc.py`)."""
    from vllm_selfspec.config import SelfSpecConfigError
    from vllm_selfspec.proposers import config_class_for

    cls = config_class_for(method)
    options = cls.options()
    assert {"probe_every", "cost_aware", "lookup"} <= set(options)  # common ones too
    assert cls.default_values() == {name: option.default for name, option in options.items()
                                    if option.default is not None}
    for name, option in options.items():
        option.check(name, option.default)
        for bound, outside in ((option.ge, -1e-9), (option.gt, 0.0),
                               (option.le, 1e-9), (option.lt, 0.0)):
            if bound is not None:
                with pytest.raises(SelfSpecConfigError, match=rf"speculative_config\.{name}: "):
                    option.check(name, bound + outside)
