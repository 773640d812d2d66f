"""Time one decode step's linear layers per weight format, on one thread.

A draft step is ~95 % matrix multiplies (`selfspec_profile_forwards`), so its
cost against a plain step is set by how fast each kernel streams its weights.
This builds every linear layer of a model's decoder (its shapes from the
model's config.json, random weights, one copy per layer so nothing stays in
cache) and times a pass through all of them for a batch of tokens:

- bf16: vLLM's unquantised CPU path (oneDNN), what a plain step runs;
- int8: the draft's W8A8 copy (vLLM's int8 kernel selector);
- int4: the draft's W4A16 copy (vLLM's mixed-precision selector);
- int4 (PyTorch): `aten._weight_int4pack_mm_for_cpu`, for comparison only.

    python scripts/bench_linear_kernels.py --model qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

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


def bf16_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """vLLM's own unquantised linear, weights processed as at load time."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    out_features, in_features = weight.shape
    layer = ReplicatedLinear(in_features, out_features, bias=False,
                             params_dtype=weight.dtype)
    layer.weight.data.copy_(weight)
    layer.quant_method.process_weights_after_loading(layer)
    return lambda x: layer(x)[0]


def torch_int4_linear(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    from vllm_selfspec.workers.draft_weights import INT4_GROUP_SIZE, quantize_int4

    quantized, scale = quantize_int4(weight)  # stored as value + 8, as this kernel wants
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(quantized, 8)
    scales_zeros = torch.stack([scale.t(), torch.zeros_like(scale.t())], dim=-1)
    scales_zeros = scales_zeros.to(weight.dtype).contiguous()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x, packed, INT4_GROUP_SIZE, scales_zeros)


def build(kind: str, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_selfspec.workers.draft_weights import Int4Linear, Int8Linear

    if kind == "bf16":
        return bf16_linear(weight)
    if kind == "int4 (PyTorch)":
        return torch_int4_linear(weight)
    with set_default_torch_dtype(weight.dtype):
        linear = {"int8": Int8Linear, "int4": Int4Linear}[kind](weight, None,
                                                                [weight.shape[0]])
    return linear


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
    parser.add_argument("--kinds", default="bf16,int8,int4,int4 (PyTorch)")
    args = parser.parse_args()

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.utils.network_utils import get_open_port

    torch.set_num_threads(1)  # as vLLM's CPU worker computes
    config = json.loads((ROOT / "models" / args.model / "config.json").read_text())
    shapes = linear_shapes(config)
    layers = config["num_hidden_layers"]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{get_open_port()}", 0,
                                     backend="gloo")
        initialize_model_parallel(1, 1)
        results = {}
        for kind in args.kinds.split(","):
            linears = []
            for _ in tqdm(range(layers), desc=kind, leave=False):
                for out_features, in_features in shapes.values():
                    weight = torch.randn(out_features, in_features,
                                         dtype=torch.bfloat16) * 0.02
                    x = torch.randn(args.batch_size, in_features, dtype=torch.bfloat16)
                    linears.append((build(kind, weight), x))
            results[kind] = time_pass(linears, args.repeats)
            del linears
    weights = layers * sum(n * k for n, k in shapes.values())
    bytes_per_weight = {"bf16": 2, "int8": 1, "int4": 0.5, "int4 (PyTorch)": 0.5}
    print(f"{args.model}: {layers} layers' linears ({weights / 1e6:.0f} M weights), "
          f"batch {args.batch_size}, 1 thread; CPU flags: {' '.join(cpu_flags())}")
    for kind, seconds in results.items():
        rate = weights * bytes_per_weight[kind] / seconds / 1e9
        print(f"  {kind:<16} {1e3 * seconds:8.1f} ms  {rate:5.1f} GB/s of weights  "
              f"{seconds / results.get('bf16', seconds):.2f} of bf16")


if __name__ == "__main__":
    main()
