"""Time one decode step's linear layers per weight format, on one thread.

A draft step is mostly matrix multiplies (`selfspec_profile_forwards`), so its
cost against a plain step is set by how fast each kernel streams its weights.
This builds every linear layer of a model's decoder (its shapes from the
model's config.json, random weights, one copy per layer so nothing stays in
cache) and times a pass through all of them for a batch of tokens:

- plain: vLLM's unquantised CPU path (oneDNN) in the model's dtype
  (`--dtype`), what a plain step runs;
- int8: the draft's int8 copy (vLLM's int8 kernel selector; on an x86 CPU
  without VNNI or AMX, fbgemm's dynamic int8 linear, timed here in eager
  Python, a little slower per layer than in a compiled draft);
- int8 (vLLM): vLLM's int8 kernel selector on any CPU;
- int8 (fbgemm): fbgemm's dynamic int8 linear on any x86 CPU;
- int4: the draft's W4A16 copy (vLLM's mixed-precision selector; where the
  vLLM build has no CPU kernel, the fallback);
- int4 (PyTorch): the fallback, `aten._weight_int4pack_mm_for_cpu`, on any CPU;
- bf16 copy: vLLM's unquantised path over a bf16 copy (for a float32 model).

`--lm-head` adds the model's LM head (vocabulary x hidden) to every pass.

    python scripts/lab/bench_linear_kernels.py --model qwen2.5-coder-1.5b
    python scripts/lab/bench_linear_kernels.py --model smollm2-135m --dtype float32 --lm-head
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from typing import Callable
from unittest import mock

import torch
from tqdm import tqdm

from vllm_selfspec.assets import ROOT, cpu_flags


def linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of a Llama/Qwen2 decoder layer's fused linears."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config.get("num_key_value_heads", config["num_attention_heads"]) * head_dim
    return {"qkv_proj": (hidden + 2 * kv, hidden), "o_proj": (hidden, hidden),
            "gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}


def unquantized_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """vLLM's own unquantised linear, weights processed as at load time."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    out_features, in_features = weight.shape
    layer = ReplicatedLinear(in_features, out_features, bias=False,
                             params_dtype=weight.dtype)
    layer.weight.data.copy_(weight)
    layer.quant_method.process_weights_after_loading(layer)
    return lambda x: layer(x)[0]


# Kinds that force one kernel: (the draft class, its kernel-choice function, its answer).
FORCED = {"int8 (vLLM)": ("int8", "vllm_int8_is_fast", True),
          "int8 (fbgemm)": ("int8", "vllm_int8_is_fast", False),
          "int4 (PyTorch)": ("int4", "vllm_int4_is_available", False)}


def build(kind: str, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_selfspec.draft.kernels import Int4Linear, Int8Linear

    if kind == "plain":
        return unquantized_linear(weight)
    if kind == "bf16 copy":
        bf16 = unquantized_linear(weight.to(torch.bfloat16))
        return lambda x: bf16(x.to(torch.bfloat16))
    precision, choice, answer = FORCED.get(kind, (kind, None, None))
    forced = (mock.patch(f"vllm_selfspec.draft.kernels.{choice}", return_value=answer)
              if choice else contextlib.nullcontext())
    with forced, set_default_torch_dtype(weight.dtype):
        return {"int8": Int8Linear, "int4": Int4Linear}[precision](
            weight, None, [weight.shape[0]])


def time_pass(linears: list[tuple[Callable, torch.Tensor]], repeats: int) -> float:
    """Median seconds of one pass through every layer's linears."""
    def run() -> None:
        for linear, x in linears:
            linear(x)

    run()
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--kinds", default="plain,int8,int8 (vLLM),int4,int4 (PyTorch)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the model's dtype: the plain path's weights and activations")
    parser.add_argument("--lm-head", action="store_true", help="time the LM head too")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.utils.network_utils import get_open_port

    torch.set_num_threads(1)  # as vLLM's CPU worker computes
    config = json.loads((ROOT / "models" / args.model / "config.json").read_text())
    shapes = linear_shapes(config)
    layers = config["num_hidden_layers"]
    head = [(config["vocab_size"], config["hidden_size"])] if args.lm_head else []
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{get_open_port()}", 0,
                                     backend="gloo")
        initialize_model_parallel(1, 1)
        results = {}
        for kind in args.kinds.split(","):
            linears = []
            matrices = [shape for _ in range(layers) for shape in shapes.values()] + head
            for out_features, in_features in tqdm(matrices, desc=kind, leave=False):
                weight = torch.randn(out_features, in_features, dtype=dtype) * 0.02
                x = torch.randn(args.batch_size, in_features, dtype=dtype)
                linears.append((build(kind, weight), x))
            results[kind] = time_pass(linears, args.repeats)
            del linears
    weights = layers * sum(n * k for n, k in shapes.values()) + sum(n * k for n, k in head)
    bytes_per_weight = {"plain": dtype.itemsize, "bf16 copy": 2, "int8": 1,
                        "int8 (vLLM)": 1, "int8 (fbgemm)": 1, "int4": 0.5, "int4 (PyTorch)": 0.5}
    print(f"{args.model}: {layers} layers' linears{' and LM head' if head else ''} "
          f"({weights / 1e6:.0f} M weights), {args.dtype}, batch {args.batch_size}, "
          f"1 thread; CPU flags: {' '.join(cpu_flags())}")
    for kind, seconds in results.items():
        rate = weights * bytes_per_weight[kind] / seconds / 1e9
        print(f"  {kind:<16} {1e3 * seconds:8.1f} ms  {rate:5.1f} GB/s of weights  "
              f"{seconds / results.get('plain', seconds):.2f} of plain")


if __name__ == "__main__":
    main()
