"""A per-op compute time model for the dry run (issue 30 item 2): each kernel timed from its shapes against a
device's row, instead of one flat efficiency over all FLOPs.

- matmuls (`mm`, `addmm`, `bmm`, `baddbmm`, `_scaled_mm`, and `_grouped_mm`, the experts' grouped GEMM: one
  kernel over all groups, its tiles quantized per group of the mean size): the larger of their math time and the time to move
  their operands. The math runs at the peak of the operands' dtype (1-byte floats at the fp8 peak, bf16 and
  fp16 at theirs, fp32 at tf32's or fp32's as `specs.peak_tflops` reads it) times the fraction of the peak that
  large GEMMs of that dtype reach (`TimingAssumptions.gemm`, from measurements: `MAMF`, and `MAMF_FP8` for fp8,
  whose GEMMs reach less of their peak on a 700 W H100 or H200), times the tile and wave
  quantization of the output over the device's SMs (NVIDIA's *Matrix Multiplication Background User's Guide*,
  https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/): small and skinny
  GEMMs fill fewer SMs and reach less of the peak.
- attention (torch's SDPA kernels, forward and backward): the FLOPs of its matmuls (the backward's five, the
  recomputation included; half of them when causal) at the fraction of the bf16 peak the SDPA backend the run's
  torch picks (FlashAttention-2 or cuDNN's: `attention_speeds.sdpa_backend`, from `torch_version` and the device)
  was measured to reach on an H100 for that direction, sequence length and mask (`attention_speeds`' tables: the
  backward slower, a causal kernel slower on the half it computes). fp32 attention runs torch's memory-efficient
  kernel, 3xTF32 MMAs: `fp32_attention_peak`, a third of the tf32 peak, at FlashAttention-2's fraction.
- everything else is memory-bound: the bytes it reads and writes over a fraction of the memory bandwidth, eager
  ATen kernels (one op each) at `eager_memory_efficiency`, the fused kernels of a compiled region at
  `memory_efficiency` (`fused_time`); views move nothing and launch nothing, nor does FSDP2's `all_gather_copy_in`
  (a wrapper: the copy it runs is recorded on its own). FSDP2's copies in and out of its collectives are never
  part of a compiled region.
- kernels the dry run does not run (torch's fused optimizer kernels, `torch._fused_adamw_`, have no fake version):
  `in_place_kernel` stands in for each launch, memory-bound, moving what it reads and writes.
- eager mode: no kernel takes less than `launch_s` (the host issues one op at a time; a kernel shorter than
  that leaves the device waiting).

Every figure is in `TimingAssumptions` (printed by `OpTimes.assumes`, overridable).

Example:
    >>> from accelfn.dryrun.timing import TimingAssumptions, matmul_time
    >>> from accelfn.platforms.specs import spec
    >>> import torch
    >>> t = matmul_time(8192, 8192, 8192, torch.bfloat16, spec("h100-sxm"), TimingAssumptions())
    >>> round(2 * 8192**3 / t / 1e12)  # TFLOP/s: H100's measured large-GEMM ceiling (792 of 989)
    788
"""

from __future__ import annotations

import bisect
import contextlib
import math
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_flatten

from ..platforms.specs import DeviceSpec, peak_tflops
from .attention_speeds import BACKENDS, FA2_H100_CAUSAL_TFLOPS, FA2_H100_TFLOPS, sdpa_backend, speeds
from .wrapped import inner_tensors

__all__ = [
    "TimingAssumptions",
    "OpTimes",
    "OpTimer",
    "OpCost",
    "op_cost",
    "cost_time",
    "matmul_time",
    "attention_time",
    "attention_fraction",
    "fp32_attention_peak",
    "FA2_H100_TFLOPS",
    "FA2_H100_CAUSAL_TFLOPS",
    "compiled_region",
    "memory_time",
    "eager_memory_time",
    "fused_time",
    "reduction_fraction",
    "in_place_kernel",
    "grouped_mm_flops",
    "grouped_mm_dtypes",
    "FLOP_FORMULAS",
]

# Maximum achievable matmul FLOPS (bf16, TFLOP/s) and the shape (m, n, k) that reached it, measured by a search
# over large shapes (stas00/ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
# comparison table": H100 SXM with CUDA 12.1, A100 SXM with CUDA 12.1, MI300X with ROCm 6.2). Rows are the
# device table's keys. The large-GEMM efficiency is this over the row's bf16 peak and over the quantization the
# model gives that shape, so that the model reproduces the measurement at its shape.
MAMF: Mapping[str, tuple[float, tuple[int, int, int]]] = {
    "h100-sxm": (792.1, (6144, 17920, 2816)),
    "a100-80gb": (267.9, (6912, 16384, 2048)),
    "a100-40gb": (267.9, (6912, 16384, 2048)),
    "mi300x": (781.9, (4096, 10240, 4864)),
    # The 500 W H100 (Meta's, torchtitan's part) from another source: pytorch/FBGEMM#2546 ("Add fp8 row/block-wise
    # scaled GEMMs", choutim, Meta, 2024-04-29), its description's "H100 500W" benchmark, bf16 (torch's GEMM,
    # presumably cuBLAS): 585.23 TFLOP/s at (8192, 8192, 8192), 575.12 at (65536, 8192, 7168), 546.31 at (65536,
    # 3584, 8192); the largest taken, as MAMF takes the maximum achievable (three shapes, not a search: the part may
    # reach more). The same run's rowwise fp8 GEMMs (CUTLASS, without quantizing): 1125.51, 1082.75, 1141.38. Not
    # published: the torch, CUDA and cuBLAS versions, the timing method (iterations, warmup, whether L2 was cleared),
    # and the part's memory (HBM2e or HBM3; a GEMM this large is not bound by it). 66% of the 886 that the device
    # table interpolates for 500 W (a 700 W H100 SXM: 792 of 989, 80%). Attention (SDPA) keeps the interpolated peak
    # times the measured FlashAttention fraction: no 500 W attention measurement was found, and a power cap slows a
    # kernel only as far as its draw exceeds the cap (one drawing less keeps its clock), while attention runs its
    # tensor cores at under half a GEMM's rate, so it is assumed to slow less than GEMMs do (an assumption, not a
    # measurement). Memory-bound kernels keep the HBM2e bandwidth.
    "h100-96gb": (585.23, (8192, 8192, 8192)),
}
# The same for fp8 (e4m3 operands, `torch._scaled_mm` with one scale per tensor, cuBLASLt; TFLOP/s of the fp8 peak)
# from the same table's FP8 rows (stas00/ml-engineering, compute/accelerator/README.md; mamf-finder.py, mean of 100
# iterations after 50 warmup ones, L2 cleared between them). H100 SXM: 1402.6 at torch 2.7.0+cu126 (commit 37acbf2,
# where the same run's bf16 row is 794.5: fp8 1.77x bf16, not the peaks' 2x; before it, at torch 2.5.1+cu121, 1344.9
# against 785.5, 1.71x); H200 SXM: 1453.4 at torch 2.7.1+cu128 (commit da5eec5). These 700 W parts reach a smaller
# fraction of their fp8 peak than of their bf16 one (71-73% against 80%). Rows without an fp8 measurement price fp8 at
# the bf16 fraction: on a 500 W H100 fp8 GEMMs were measured at 1.88-2.09x bf16 ones (pytorch/FBGEMM#2546, rowwise),
# on a 600 W H200 NVL at 1.90x (TransformerEngine's GEMM profiling tutorial, tensorwise): docs/dry_run.md item 14.
MAMF_FP8: Mapping[str, tuple[float, tuple[int, int, int]]] = {
    "h100-sxm": (1402.6, (1024, 9216, 14336)),
    "h200-sxm": (1453.4, (1280, 4096, 12032)),
}
# Streaming multiprocessors per device (NVIDIA's data sheets and whitepapers: A100 108, H100 SXM 132; the H200
# and GH200 carry the H100 SXM's die).
SM_COUNT: Mapping[str, int] = {
    "h100-sxm": 132,
    "h100-96gb": 132,  # the H100 SXM die with 96 GB (torchtitan's benchmark GPUs)
    "h200-sxm": 132,
    "gh200": 132,
    "a100-80gb": 108,
    "a100-40gb": 108,
}
_H100_BF16 = 989.0
# torch.compile's kernels for a reduction over rows of N elements, on an H100 80GB HBM3 (3.35 TB/s): Dao-AILab/quack,
# "Getting Memory-bound Kernels to Speed-of-Light" (Guo, Zadouri, Dao 2025: media/2025-07-10-membound-sol.md), the
# figure "Model memory throughput of multiple kernels", RMSNorm in bf16 under torch 2.7.1's default compile, 32k
# rows (16k and 8k at the two longest): GB/s by N, read from the figure (about +-30 GB/s). A hand-written kernel
# reaches 2.9-3.0 TB/s from N 2k; inductor's 58-69% of the bandwidth at N 1k-4k, where `memory_efficiency` says 90%.
TORCH_COMPILE_REDUCTION_GBS: Mapping[int, float] = {
    256: 1275.0,
    512: 1575.0,
    1024: 1950.0,
    2048: 2180.0,
    4096: 2300.0,
    8192: 1945.0,
    16384: 1810.0,
    32768: 1775.0,
    65536: 1530.0,
    131072: 1505.0,
    262144: 1500.0,
}
_H100_HBM3_GBS = 3350.0

_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm"}
# CUDA rows before compute capability 9.0, where torch's `_grouped_mm` does not run (accelfn's CUDA platform picks
# it from 9.0: Hopper, Blackwell, and ROCm's MI300 series, which report 9.4)
_NO_GROUPED_MM = {"a100-40gb", "a100-80gb", "l40s", "l4", "a10g"}
_COMMUNICATION = {"c10d", "_c10d_functional", "c10d_functional", "_dtensor"}  # the comm model's, not compute
# FSDP2's own ops (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py). `fsdp::all_gather_copy_in` only wraps
# the `_foreach_copy_` it runs, which the dry run records on its own (the shards cast and copied into the all-gather's
# buffer): the wrapper moves nothing itself (counted as its whole output, it was 6x its copy). Its copy, the copy-out
# (`fsdp::split_with_sizes_copy`) and the reduce-scatter's copy-in (`fsdp::chunk_cat`) run in FSDP2's hooks, around
# the blocks that torch.compile compiles (torchtitan's `apply_compile`, and af.compile under FSDP: each block), so they
# are never fused into a compiled region's kernels: eager, one kernel each, in the backward too.
_WRAPPERS = {("fsdp", "all_gather_copy_in")}
_NEVER_FUSED = {("fsdp", "split_with_sizes_copy"), ("fsdp", "chunk_cat"), ("aten", "_foreach_copy_")}
_FREE = {
    "_unsafe_view",
    "alias",
    "empty",
    "empty_strided",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "detach",
    "lift_fresh",
}


@attrs.frozen
class TimingAssumptions:
    """The figures the compute time model assumes; each is in `OpTimes.assumes`.

    `gemm_efficiency`: the fraction of the dense peak large GEMMs reach (None: the device's measured figure in
    `MAMF`, else `default_gemm_efficiency`; fp8 GEMMs reach it times their measured share, `MAMF_FP8`: `gemm`);
    `tiles`: the output tile sizes one SM may compute (the guide: cuBLAS picks among several, 256x128 the largest;
    the model takes the one that wastes least, at the same efficiency: an assumption); `sm_count` (None: `SM_COUNT`, no wave quantization where unknown); `attention_efficiency`:
    the fraction of the bf16 peak FlashAttention-2's forward kernel reaches on a long sequence without a mask (on
    H100: 370 of 989 TFLOP/s); each attention kernel runs at it times its backend's measured speed for the
    kernel's direction, key length and mask over that figure (`attention_fraction`: the backward and short
    sequences slower, cuDNN's kernels faster); `attention_backend`: the SDPA backend, "flash2" or "cudnn" (None:
    the one torch `torch_version` picks on the device, `attention_speeds.sdpa_backend`); `torch_version`: the
    torch the job runs (default: the installed one); `memory_efficiency`: the fraction of the memory bandwidth a
    compiled (fused, Triton) memory-bound kernel reaches (hand-written Triton kernels' 91-92%: Liger-Kernel's H100
    data); `eager_memory_efficiency`: an eager ATen kernel's (Liger-Kernel's H100 data: transformers' add +
    RMSNorm, seven ATen kernels, 84%); `reduction_efficiency`: the fraction a compiled kernel with a reduction
    reaches (None: torch.compile's measured RMSNorm for the reduced length, `reduction_fraction`, times
    `reduction_scale`: 1.0, or a calibration's scale of the compute model, `accelfn.planner.calibrate`); `launch_s`: the
    least time one kernel takes in eager mode (an assumption: the host's cost of issuing one op); `eager`: whether
    that floor applies (False under `af.compile`, whose kernels are issued together).
    """

    gemm_efficiency: float | None = None
    default_gemm_efficiency: float = 0.8
    tiles: tuple[tuple[int, int], ...] = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))
    sm_count: int | None = None
    attention_efficiency: float = FA2_H100_TFLOPS[16384][0] / _H100_BF16
    attention_backend: str | None = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.in_(BACKENDS))
    )
    torch_version: str = attrs.Factory(lambda: torch.__version__)
    memory_efficiency: float = 0.9
    eager_memory_efficiency: float = 0.84
    reduction_efficiency: float | None = None
    reduction_scale: float = 1.0
    launch_s: float = 5e-6
    eager: bool = True

    def gemm(self, device: DeviceSpec, dtype: torch.dtype = torch.bfloat16) -> float:
        """The fraction of `dtype`'s peak large GEMMs reach on `device`: `gemm_efficiency`, else the device's
        measured bf16 figure (`MAMF`, over the quantization the model gives the measured shape, so that the model
        reproduces the measurement there; `default_gemm_efficiency` where it has no row); for fp8 (1-byte operands)
        times the fraction of it that the device's fp8 GEMMs were measured to reach (`MAMF_FP8` over `MAMF`; 1
        where it has no fp8 row), so that a calibration's scale of `gemm_efficiency` carries to fp8.

        Example:
            >>> from accelfn.platforms.specs import spec
            >>> a = TimingAssumptions()
            >>> round(a.gemm(spec("h100-sxm")), 3), round(a.gemm(spec("h100-sxm"), torch.float8_e4m3fn), 3)
            (0.802, 0.731)
            >>> round(a.gemm(spec("h100-96gb")), 3)  # the 500 W H100's measured 585 of its 886 (MAMF)
            0.665
            >>> a.gemm(spec("h100-96gb"), torch.float8_e4m3fn) == a.gemm(spec("h100-96gb"))  # no fp8 row: bf16's
            True
        """
        bf16 = self.gemm_efficiency if self.gemm_efficiency is not None else self._measured(device, MAMF)
        if dtype.itemsize != 1 or device.key not in MAMF_FP8:
            return bf16
        return bf16 * self._measured(device, MAMF_FP8, dtype) / self._measured(device, MAMF)

    def _measured(
        self,
        device: DeviceSpec,
        table: Mapping[str, tuple[float, tuple[int, int, int]]],
        dtype: torch.dtype = torch.bfloat16,
    ) -> float:
        """`table`'s measured large-GEMM TFLOP/s of `device` over `dtype`'s peak and the model's quantization of
        the measured shape (`default_gemm_efficiency` where `table` has no row)."""
        if device.key not in table:
            return self.default_gemm_efficiency
        tflops, (m, n, _) = table[device.key]
        return tflops * 1e12 / _peak(device, dtype) / _quantization(m, n, 1, self.tiles, self.sms(device))

    def sms(self, device: DeviceSpec) -> int | None:
        return self.sm_count if self.sm_count is not None else SM_COUNT.get(device.key)

    def backend(self, device: DeviceSpec) -> str:
        """The SDPA backend attention is charged as on `device`: `attention_backend`, else the one torch
        `torch_version` picks there.

        Example:
            >>> from accelfn.platforms.specs import spec
            >>> TimingAssumptions(torch_version="2.6.0.dev20241223").backend(spec("h100-96gb"))
            'flash2'
            >>> TimingAssumptions(torch_version="2.11.0+cu130").backend(spec("h100-sxm"))
            'cudnn'
        """
        if self.attention_backend is not None:
            return self.attention_backend
        return sdpa_backend(self.torch_version, device.key)

    def attention(
        self, backward: bool = False, seq: int = 0, causal: bool = False, backend: str = "flash2"
    ) -> float:
        """The fraction of the bf16 peak an attention kernel of `backend` reaches: `attention_efficiency` (a
        long non-causal FlashAttention-2 forward's) times the backend's measured speed for the kernel's direction,
        key length and mask over that forward's (`attention_fraction`).

        Example:
            >>> a = TimingAssumptions()
            >>> round(a.attention(), 3), round(a.attention(backward=True, seq=8192), 3)
            (0.374, 0.322)
            >>> round(a.attention(seq=8192, causal=True), 3)  # 333 TFLOP/s
            0.337
            >>> round(a.attention(seq=2048, causal=True, backend="cudnn") * 989)  # cuDNN: 484 TFLOP/s
            484
        """
        return (
            self.attention_efficiency
            * attention_fraction(backward, seq, causal, backend)
            / attention_fraction()
        )


def attention_fraction(
    backward: bool = False, seq: int = 0, causal: bool = False, backend: str = "flash2"
) -> float:
    """The measured fraction of the H100's bf16 peak of `backend`'s SDPA kernel ("flash2": FlashAttention-2,
    "cudnn": cuDNN's; `attention_speeds.speeds`), forward or backward over `seq` keys, without a causal mask or
    with one (its backward an assumption), interpolated in log2 of the length and held at the table's ends (0:
    the longest).

    Example:
        >>> round(attention_fraction(False, 8192), 3), round(attention_fraction(True, 8192), 3)
        (0.374, 0.322)
        >>> round(attention_fraction(True, 3000), 3)  # between 2k (291) and 4k (310) TFLOP/s
        0.305
        >>> round(attention_fraction(False, 2048, causal=True) * 989)  # causal: 298 TFLOP/s where 362 without
        298
        >>> round(attention_fraction(True, 2048, backend="cudnn") * 989)  # cuDNN's backward: 465
        465
    """
    table = speeds(backend, causal)
    lengths = sorted(table)
    pick = 1 if backward else 0
    seq = lengths[-1] if seq <= 0 else min(max(seq, lengths[0]), lengths[-1])
    hi = next(n for n in lengths if n >= seq)
    lo = lengths[max(0, lengths.index(hi) - 1)]
    w = (math.log2(seq) - math.log2(lo)) / (math.log2(hi) - math.log2(lo)) if hi != lo else 1.0
    tflops = table[lo][pick] * (1 - w) + table[hi][pick] * w
    return tflops / _H100_BF16


def _quantization(m: int, n: int, batch: int, tiles: tuple[tuple[int, int], ...], sms: int | None) -> float:
    """The fraction of the SMs' tile work that is useful, for the tile size that wastes least: the output padded
    to whole tiles, the tiles run in whole waves over the SMs (1.0 for a large output)."""
    best = 0.0
    for tm, tn in tiles:
        count = math.ceil(m / tm) * math.ceil(n / tn) * batch
        useful = m * n * batch / (count * tm * tn)
        if sms is not None:
            useful *= count / (math.ceil(count / sms) * sms)
        best = max(best, useful)
    return best


def _peak(device: DeviceSpec, dtype: torch.dtype) -> float:
    peak = peak_tflops(device, dtype)
    if peak is None:
        raise ValueError(
            f"accelfn.dryrun.timing: the device table's row {device.key!r} has no peak for {dtype}: add one "
            "to accelfn/platforms/specs.py or model another dtype"
        )
    return peak * 1e12


def reduction_fraction(n: int) -> float:
    """The fraction of an H100's memory bandwidth torch.compile's kernel for a reduction over rows of `n` elements
    was measured to reach (`TORCH_COMPILE_REDUCTION_GBS`, interpolated in log2 of `n`, held at the ends).

    Example:
        >>> round(reduction_fraction(2048), 2), round(reduction_fraction(3000), 2)
        (0.65, 0.67)
    """
    lengths = sorted(TORCH_COMPILE_REDUCTION_GBS)
    n = min(max(n, lengths[0]), lengths[-1])
    hi = next(x for x in lengths if x >= n)
    lo = lengths[max(0, lengths.index(hi) - 1)]
    w = (math.log2(n) - math.log2(lo)) / (math.log2(hi) - math.log2(lo)) if hi != lo else 1.0
    gbs = TORCH_COMPILE_REDUCTION_GBS[lo] * (1 - w) + TORCH_COMPILE_REDUCTION_GBS[hi] * w
    return gbs / _H100_HBM3_GBS


def fused_time(nbytes: int, reduce: int, device: DeviceSpec, assumptions: TimingAssumptions) -> float:
    """Seconds of one compiled (fused) memory-bound kernel moving `nbytes`: with a reduction over rows of `reduce`
    elements (256 or more: shorter ones inductor runs like pointwise kernels) at `reduction_efficiency` (None:
    `reduction_fraction(reduce)` times `reduction_scale`) of the bandwidth, else at `memory_efficiency`.

    Example:
        >>> from accelfn.platforms.specs import spec
        >>> a, h100 = TimingAssumptions(), spec("h100-sxm")
        >>> round(fused_time(10**9, 2048, h100, a) / fused_time(10**9, 0, h100, a), 2)  # 0.9 / 0.65
        1.38
    """
    if reduce < min(TORCH_COMPILE_REDUCTION_GBS):
        return memory_time(nbytes, device, assumptions)
    fraction = assumptions.reduction_efficiency
    if fraction is None:
        fraction = reduction_fraction(reduce) * assumptions.reduction_scale
    return nbytes / (device.memory_gbs * 1e9 * fraction)


def memory_time(nbytes: int, device: DeviceSpec, assumptions: TimingAssumptions) -> float:
    """Seconds to move `nbytes` through the device's memory (no launch floor).

    Example:
        >>> from accelfn.platforms.specs import spec
        >>> memory_time(3_350_000_000, spec("h100-sxm"), TimingAssumptions(memory_efficiency=1.0))
        0.001
    """
    return nbytes / (device.memory_gbs * 1e9 * assumptions.memory_efficiency)


def eager_memory_time(nbytes: int, device: DeviceSpec, assumptions: TimingAssumptions) -> float:
    """Seconds of one eager (ATen, not fused) memory-bound kernel moving `nbytes`, at `eager_memory_efficiency`
    of the bandwidth (no launch floor).

    Example:
        >>> from accelfn.platforms.specs import spec
        >>> h100, a = spec("h100-sxm"), TimingAssumptions()
        >>> round(eager_memory_time(10**9, h100, a) / memory_time(10**9, h100, a), 3)  # 0.90 / 0.84
        1.071
    """
    return nbytes / (device.memory_gbs * 1e9 * assumptions.eager_memory_efficiency)


def matmul_time(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    device: DeviceSpec,
    assumptions: TimingAssumptions,
    *,
    batch: int = 1,
    out_bytes: int = 2,
) -> float:
    """Seconds of one (batched) `m x k @ k x n` GEMM with operands in `dtype` (no launch floor): the larger of
    its math time (quantized as the module docs say) and its memory time.

    Example:
        >>> from accelfn.platforms.specs import spec
        >>> h100, a = spec("h100-sxm"), TimingAssumptions()
        >>> big = matmul_time(8192, 8192, 8192, torch.bfloat16, h100, a)
        >>> skinny = matmul_time(8192, 8192, 64, torch.bfloat16, h100, a)  # memory-bound: 2 * 64 FLOPs / 2 B
        >>> 2 * 8192 * 8192 * 64 / skinny < 0.5 * 2 * 8192**3 / big
        True
    """
    flops = 2 * m * n * k * batch
    q = _quantization(m, n, batch, assumptions.tiles, assumptions.sms(device))
    math_s = flops / (_peak(device, dtype) * assumptions.gemm(device, dtype) * q)
    size = torch.empty((), dtype=dtype).element_size()
    moved = (m * k + k * n) * batch * size + m * n * batch * out_bytes
    return max(math_s, memory_time(moved, device, assumptions))


def attention_time(
    flops: int,
    device: DeviceSpec,
    assumptions: TimingAssumptions,
    dtype: torch.dtype = torch.bfloat16,
    *,
    backward: bool = False,
    seq: int = 0,
    causal: bool = False,
) -> float:
    """Seconds of an attention kernel doing `flops` (its matmuls', the computed half's when causal) at
    `assumptions.attention(backward, seq, causal, backend)` of the peak (`backward`: SDPA's backward kernel; `seq`:
    its key length; `causal`: with a causal mask; the backend `assumptions.backend(device)`).

    Example:
        >>> from accelfn.platforms.specs import spec
        >>> fa2 = TimingAssumptions(attention_backend="flash2")
        >>> attention_time(989 * 10**12, spec("h100-sxm"), attrs.evolve(fa2, attention_efficiency=0.5))
        2.0
        >>> fwd = attention_time(10**12, spec("h100-sxm"), fa2, seq=8192)
        >>> bwd = attention_time(10**12, spec("h100-sxm"), fa2, backward=True, seq=8192)
        >>> round(bwd / fwd, 3)  # FlashAttention-2 on H100: 370 TFLOP/s forward, 318 backward
        1.164
        >>> cudnn = TimingAssumptions(torch_version="2.11.0")  # cuDNN's kernels on an H100
        >>> round(attention_time(10**12, spec("h100-sxm"), cudnn, seq=8192) / fwd, 3)  # 370 / 600 TFLOP/s
        0.617
    """
    if dtype.itemsize > 2:
        # SDPA's flash and cuDNN kernels take only 2-byte inputs: fp32 runs the memory-efficient kernel, whose
        # matmuls on sm80+ are 3xTF32 (`OpMultiplyAddFastF32`, whatever `allow_tf32` says; torch's
        # mem_eff_attention/gemm_kernel_utils.h): a third of the tf32 peak (the fp32 one where the device has no
        # tf32), at FlashAttention-2's measured fraction (its kernel, too, runs sm80 MMA instructions)
        fraction = assumptions.attention(backward, seq, causal, "flash2")
        return flops / (fp32_attention_peak(device) * 1e12 * fraction)
    return flops / (
        _peak(device, dtype) * assumptions.attention(backward, seq, causal, assumptions.backend(device))
    )


def fp32_attention_peak(device: DeviceSpec) -> float:
    """The TFLOP/s an fp32 SDPA call's matmuls can reach on `device`: on an NVIDIA GPU, a third of the tf32 peak
    (torch's memory-efficient kernel splits each fp32 operand in two TF32 halves and runs three TF32 MMAs on
    compute capability 8.0 and later); elsewhere (AMD's ROCm kernels, or no tf32 row) the fp32 peak, else (a row
    with neither: TPUs, Gaudi) the bf16 one.

    Example:
        >>> from accelfn.platforms.specs import spec
        >>> round(fp32_attention_peak(spec("h100-sxm")), 1), fp32_attention_peak(spec("a100-80gb"))
        (164.9, 52.0)
        >>> fp32_attention_peak(spec("mi300x")), fp32_attention_peak(spec("tpu-v5p"))
        (163.4, 459.0)
    """
    if device.name.startswith("NVIDIA") and "tf32" in device.tflops:
        return device.tflops["tf32"] / 3
    for key in ("fp32", "bf16"):
        if key in device.tflops:
            return device.tflops[key]
    return _peak(device, torch.bfloat16) / 1e12


@attrs.define
class OpTimes:
    """Seconds by kind of kernel (`matmul`, `attention`, `memory`), kernels launched, the kernels the launch
    floor set, and the assumptions."""

    seconds: dict[str, float] = attrs.Factory(lambda: {"matmul": 0.0, "attention": 0.0, "memory": 0.0})
    kernels: int = 0
    launch_bound: int = 0
    assumes: dict[str, Any] = attrs.Factory(dict)

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _arg(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    """The argument `name` of an aten op's call, by its schema (None when it has none)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == name:
            return args[i] if i < len(args) else kwargs.get(name, a.default_value)
    return None


def _causal_mask(mask: Any, lq: int, lk: int) -> bool:
    """Whether an SDPA call's explicit mask is a decoder's causal mask. transformers builds one (B or 1, 1, L, L)
    where the CPU kernel needs it (the dry run's case), where on CUDA it passes `is_causal` and the flash kernel
    skips the masked half. A real mask is read: causal when exactly the keys after each query are masked (a bool
    mask's False, a float mask's large negative values). A fake or meta one has no values: any square mask shared
    by all heads is taken as causal (an assumption: a bidirectional padding mask looks the same)."""
    if not isinstance(mask, torch.Tensor) or lq != lk or mask.ndim < 2 or mask.shape[-2:] != (lq, lq):
        return False
    if mask.ndim > 2 and mask.shape[-3] != 1:
        return False
    if mask.is_meta or isinstance(mask, FakeTensor) or type(mask) is not torch.Tensor:
        return True
    if mask.dtype != torch.bool and not mask.is_floating_point():
        return False
    with _disable_current_modes():  # read the values without the dry run's modes seeing it
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        tril = torch.ones(lq, lq, dtype=torch.bool, device=mask.device).tril()
        return bool((allowed == tril).all())


def _sdpa_flops(
    func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[int, bool, bool] | None:
    """FLOPs of a torch SDPA kernel's matmuls from its query (B, H, L, D) and key (the computed part's when
    causal: half when as many queries as keys; with fewer queries, counted as the last ones of the keys'
    sequence, as context parallel's chunks are), whether it is causal (`is_causal`, or an explicit causal mask: `_causal_mask`) and whether it was
    given an explicit mask; None for other ops."""
    if not name.startswith("_scaled_dot_product_") or "attention" not in name:
        return None
    q, k = _arg(func, args, kwargs, "query"), _arg(func, args, kwargs, "key")
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor):
        return None
    b, h, lq, d = q.shape
    per_matmul = 2 * b * h * lq * k.shape[-2] * d
    flops = (5 if name.endswith("_backward") else 2) * per_matmul  # the backward recomputes q @ k^T
    mask = _arg(func, args, kwargs, "attn_mask")  # the efficient and cuDNN kernels call it attn_bias
    mask = mask if mask is not None else _arg(func, args, kwargs, "attn_bias")
    lk = int(k.shape[-2])
    causal = bool(_arg(func, args, kwargs, "is_causal")) or _causal_mask(mask, lq, lk)
    if causal and lk > lq:
        # counted lower-right (the queries are the last lq positions, query i sees lk - lq + i + 1 keys): context
        # parallel's calls in a dry run of a GPU job, which its CausalBias runs on the GPU as the flash kernel's
        # is_causal; torch's public is_causal with fewer queries than keys is upper-left (fewer FLOPs)
        flops = flops * (2 * lk - lq) // (2 * lk)
    elif causal:
        flops //= 2
    return flops, causal, isinstance(mask, torch.Tensor)


@attrs.frozen(slots=True)
class OpCost:
    """What one kernel does, independent of the device: a matmul's `(m, n, k, batch)` in `dtype` with an output
    of `out_bytes` per element, an attention kernel's `flops` (`seq` its key length, `backward_kernel` SDPA's
    backward, `causal` with a causal mask, `mask` given it as an explicit mask), or a memory-bound kernel's
    `nbytes` moved (`reduce`: the length of the rows a reduction reduces, 0 for none; `whole`: it reduces its whole
    input to one value, as torchao's tensorwise amax does, so what reads the value waits for every block of it;
    `reads` and `writes`: the tensors it reads and writes as (storage, view, bytes), the storage a number unique
    to it in this process and the view one per offset and shape: what `step_time.run_bytes` follows through a
    fused run; `handed_on`: AccumulateGrad's copy of a compiled backward's gradient, which a compiled step hands on
    as it is); `backward` whether autograd ran it; `graph` whether it ran in the forward (grad enabled) or
    the backward, what a compiled step compiles (False: the update, and no-grad work outside the backward such
    as FSDP's copies after its all-gathers, which stay eager); `region` whether a compiled block ran it (its
    forward inside `compiled_region`, or in the backward the backward of an autograd node made there: what a step
    compiled per block compiles; False: the loss, the head, the embedding and FSDP's hooks around the blocks).
    The dry run's tracker records one per op, `cost_time` times it.

    Example:
        >>> from accelfn.platforms.specs import spec
        >>> c = OpCost("memory", nbytes=3_350_000_000)
        >>> cost_time(c, spec("h100-sxm"), TimingAssumptions(eager_memory_efficiency=1.0))
        0.001
    """

    kind: str  # "matmul", "attention" or "memory"
    m: int = 0
    n: int = 0
    k: int = 0
    batch: int = 1
    dtype: torch.dtype = torch.bfloat16
    out_bytes: int = 2
    flops: int = 0
    nbytes: int = 0
    backward: bool = False
    graph: bool = True
    seq: int = 0
    backward_kernel: bool = False
    region: bool = True
    causal: bool = False
    mask: bool = False
    reduce: int = 0
    whole: bool = False
    reads: tuple[tuple[int, int, int], ...] = ()
    writes: tuple[tuple[int, int, int], ...] = ()
    handed_on: bool = (
        False  # AccumulateGrad's copy of a compiled backward's gradient: no kernel in a fused run
    )


_REGION = [0]  # how deep the ops running now are inside compiled blocks' forwards (`compiled_region`)
# the autograd sequence numbers of the nodes made inside compiled regions' forwards: [start, end) per region, in
# the order they ran (a node's `_sequence_nr()` is its creation order, so the backward knows its region's nodes)
_REGION_NODES: list[tuple[int, int]] = []


@contextlib.contextmanager
def compiled_region() -> Iterator[None]:
    """Marks the ops run inside it as a compiled region's (`OpCost.graph`): the dry run's compiled blocks run
    their forward in it, where autograd.Function forwards (the partitioned graph's, torchao's float8 matmul's)
    run with grad disabled, as the update does.

    Example:
        >>> with compiled_region():
        ...     with torch.no_grad():
        ...         c = op_cost(torch.ops.aten.neg.default, (torch.ones(4),), {}, torch.ones(4))
        >>> c.graph
        True
    """
    # the forward's own nodes only: a checkpoint's recomputation in the backward runs on the engine's thread,
    # whose sequence numbers are its own (and its nodes are never run backward)
    outermost = _REGION[0] == 0 and torch._C._current_graph_task_id() == -1
    start = torch._C._autograd._get_sequence_nr() if outermost else None
    _REGION[0] += 1
    try:
        yield
    finally:
        _REGION[0] -= 1
        if start is not None:
            end = torch._C._autograd._get_sequence_nr()
            if end > start:
                bisect.insort(_REGION_NODES, (start, end))


def _in_region_backward() -> bool:
    """Whether the autograd node running now was made inside a compiled region's forward, or is autograd's
    accumulation of a gradient into its parameter: the dry run's partitioned backward graphs hand their gradients
    on with references still held, so `AccumulateGrad` copies them (bf16, same strides) where a compiled backward's
    fresh outputs are taken as they are (it does not copy them in the eager trace either): counted as the region's."""
    node = torch._C._current_autograd_node()
    if node is None:
        return False
    if node.name() == "torch::autograd::AccumulateGrad":
        return True
    seq = node._sequence_nr()
    i = bisect.bisect_right(_REGION_NODES, (seq, math.inf)) - 1
    return i >= 0 and _REGION_NODES[i][0] <= seq < _REGION_NODES[i][1]


_KIND: dict[Any, str] = {}  # op overload -> "", "matmul", "sdpa" or "memory" (classified once)


def _kind(func: Any) -> str:
    kind = _KIND.get(func)
    if kind is None:
        name = func.__name__.split(".")[0]
        namespace = getattr(func, "namespace", "")
        if (
            getattr(func, "is_view", False)
            or name in _FREE
            or namespace == "prim"
            or namespace in _COMMUNICATION
            or (namespace, name) in _WRAPPERS
        ):
            kind = ""
        elif name in _MATMULS:
            kind = "matmul"
        elif name.startswith("_scaled_dot_product_") and "attention" in name:
            kind = "sdpa"
        else:
            kind = "memory"
        _KIND[func] = kind
    return kind


@torch.library.custom_op("accelfn::in_place_kernel", mutates_args=("written",))
def _in_place_kernel(read: list[torch.Tensor], written: list[torch.Tensor]) -> None:
    return None


@_in_place_kernel.register_fake
def _(read: list[torch.Tensor], written: list[torch.Tensor]) -> None:
    return None


def in_place_kernel(read: Sequence[torch.Tensor], written: Sequence[torch.Tensor]) -> None:
    """Stands in for one launch of an in-place kernel the dry run does not run (torch's fused optimizer kernels:
    `torch._fused_adamw_` has no fake version): it computes and allocates nothing, and the dry run's tracker
    records it as one memory-bound kernel that reads `read` and reads and writes `written` (`op_cost`).
    DTensors stand for their local shards.

    Example:
        >>> from accelfn.platforms.specs import spec
        >>> p, g, m, v = (torch.zeros(1000) for _ in range(4))
        >>> with OpTimer(spec("h100-sxm"), TimingAssumptions(launch_s=0.0)) as t:
        ...     in_place_kernel([g], [p, m, v])  # AdamW: 4 x 4 bytes read, 3 x 4 written per parameter
        >>> t.times.seconds["memory"] == eager_memory_time(28 * 1000, spec("h100-sxm"), TimingAssumptions())
        True
    """

    def local(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [t.to_local() if hasattr(t, "to_local") else t for t in ts]

    _in_place_kernel(local(read), local(written))


_IN_PLACE = torch.ops.accelfn.in_place_kernel.default


_STORAGES: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()  # storage -> its number


def _io(x: Any) -> list[tuple[int, int, int]] | None:
    """(storage, view, bytes) of each tensor in an op's argument or output (one level of list / tuple; a wrapper
    subclass by the tensors it holds, as `_bytes_of`); None where a tensor has no storage to name."""
    if is_traceable_wrapper_subclass(x):
        out: list[tuple[int, int, int]] = []
        for t in inner_tensors(x):
            inner = _io(t)
            if inner is None:
                return None
            out += inner
        return out
    if isinstance(x, torch.Tensor):
        try:
            storage = x.untyped_storage()
            number = _STORAGES.get(storage)
            if number is None:
                number = _STORAGES[storage] = next(_SERIAL)
        except (NotImplementedError, RuntimeError, TypeError):
            return None
        view = hash((x.storage_offset(), tuple(x.shape), tuple(x.stride())))
        # the elements stored: an expanded dimension (stride 0) reads one element along it
        stored = math.prod(n for n, st in zip(x.shape, x.stride()) if st != 0) if x.numel() else 0
        return [(number, view, stored * x.element_size())]
    if isinstance(x, (list, tuple)):
        out = []
        for t in x:
            if isinstance(t, torch.Tensor):
                inner = _io(t)
                if inner is None:
                    return None
                out += inner
        return out
    return []


_SERIAL = iter(range(1 << 62))


# ops whose first argument gives only a shape / dtype, or is only written: they do not read it
_WRITES_FIRST = frozenset(
    {"copy_", "fill_", "zero_", "normal_", "uniform_", "random_", "exponential_", "geometric_", "log_normal_"}
    | {"zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like"}
    | {"new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided"}
)


def _op_io(
    func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any], out: Any
) -> tuple[tuple[tuple[int, int, int], ...], tuple[tuple[int, int, int], ...]]:
    """An op's `OpCost.reads` and `OpCost.writes` (both empty where a tensor has no storage to name); the first
    argument of an op that only takes its shape or writes it (`zeros_like`, `copy_`'s destination, `fill_`) is
    not read."""
    reads: list[tuple[int, int, int]] = []
    skip_first = args and getattr(func, "__name__", "").split(".")[0] in _WRITES_FIRST
    for a in [*(args[1:] if skip_first else args), *(v for k, v in kwargs.items() if k != "out")]:
        r = _io(a)
        if r is None:
            return (), ()
        reads += r
    w = _io(out if out is not None else kwargs.get("out"))
    if w is None:
        return (), ()
    return tuple(reads), tuple(w)


def _bytes_of(x: Any) -> int:
    """Bytes of the tensors in an op's argument or output (a tensor, or a list / tuple of them, one level); a
    tensor subclass that wraps others (torchao's float8 tensors: the dtype they stand for over 1-byte data, the
    op on them seen once, at their level) by the tensors it holds, which its kernels read and write.

    Example:
        >>> from torchao.float8.float8_training_tensor import Float8TrainingTensor, LinearMMConfig
        >>> t = Float8TrainingTensor(torch.ones(1024, dtype=torch.float8_e4m3fn), torch.tensor(1.0), torch.bfloat16,
        ...                          LinearMMConfig())
        >>> _bytes_of(t), _bytes_of(torch.ones(1024, dtype=torch.bfloat16))  # data and scale, not 2 bytes each
        (1028, 2048)
    """
    if is_traceable_wrapper_subclass(x):
        return sum(_bytes_of(t) for t in inner_tensors(x))
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_bytes_of(t) for t in x if isinstance(t, torch.Tensor))
    return 0


def op_cost(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> OpCost | None:
    """The `OpCost` of one aten op (None for views, allocations and collectives: they launch no compute kernel
    or are the communication model's)."""
    kind = _kind(func)
    if not kind:
        return None
    backward = torch._C._current_graph_task_id() != -1
    graph = (backward or torch.is_grad_enabled() or _REGION[0] > 0) and (
        getattr(func, "namespace", ""),
        func.__name__.split(".")[0],
    ) not in _NEVER_FUSED
    region = graph and (_REGION[0] > 0 or (backward and _in_region_backward()))
    # AccumulateGrad's copy of a region's gradient (the parameter's first; a copy where the dry run's partitioned
    # backward still holds a reference): a compiled backward hands its outputs on as they are (see
    # `_in_region_backward`), so in a fused run it moves nothing of its own (`handed_on`).
    # Its add into a `.grad` already there (accumulation's micro-batches 2..n, a pipeline's 2..m) is a kernel of
    # its own after the compiled backward's: priced as an eager op.
    node = torch._C._current_autograd_node() if region and backward else None
    reads: tuple[tuple[int, int, int], ...]
    writes: tuple[tuple[int, int, int], ...]
    handed_on = False
    if node is not None and node.name() == "torch::autograd::AccumulateGrad":
        if func.__name__.split(".")[0] in ("add", "add_"):
            graph = region = False
            reads, writes = _op_io(func, args, kwargs, out)
        else:
            reads, writes, handed_on = (), (), True
    else:
        reads, writes = _op_io(func, args, kwargs, out)
    if func is _IN_PLACE:  # what it writes, it read first
        return OpCost(
            "memory",
            nbytes=_bytes_of(args[0]) + 2 * _bytes_of(args[1]),
            backward=backward,
            graph=graph,
            region=region,
            reads=reads,
            writes=writes,
            handed_on=handed_on,
        )
    if kind == "memory":
        moved = sum(_bytes_of(a) for a in args) + sum(_bytes_of(v) for v in kwargs.values()) + _bytes_of(out)
        return OpCost(
            "memory",
            nbytes=moved,
            backward=backward,
            graph=graph,
            region=region,
            reduce=_reduced(func, args, kwargs, out),
            whole=_whole(func, args, out),
            reads=reads,
            writes=writes,
            handed_on=handed_on,
        )
    name = func.__name__.split(".")[0]
    if kind == "matmul":
        x, w = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
        outs = _tensors(out)
        size = outs[0].element_size() if outs else 2
        if name in ("_grouped_mm", "_scaled_grouped_mm"):  # scaled: fp8 experts (accelfn.moe.experts)
            m, n, k, groups = _grouped_shape(x, w)
            # the weight gradient: out [G, K, N]
            if x.ndim == 2 and w.ndim == 2 and outs and outs[0].ndim == 3:
                groups = outs[0].shape[0]
                m, k = x.shape[0], max(1, x.shape[1] // groups)
            return OpCost(
                "matmul",
                m,
                n,
                k,
                groups,
                _math_dtype(x),
                size,
                backward=backward,
                graph=graph,
                region=region,
                reads=reads,
                writes=writes,
            )
        batch = x.shape[0] if x.ndim == 3 else 1
        return OpCost(
            "matmul",
            x.shape[-2],
            w.shape[-1],
            x.shape[-1],
            batch,
            _math_dtype(x),
            size,
            backward=backward,
            graph=graph,
            region=region,
            reads=reads,
            writes=writes,
        )
    sdpa = _sdpa_flops(func, name, args, kwargs)
    if sdpa is None:
        return None
    flops, causal, masked = sdpa
    q, k = _arg(func, args, kwargs, "query"), _arg(func, args, kwargs, "key")
    return OpCost(
        "attention",
        flops=flops,
        dtype=q.dtype,
        backward=backward,
        graph=graph,
        region=region,
        seq=int(k.shape[-2]),
        backward_kernel=name.endswith("_backward"),
        causal=causal,
        mask=masked,
        reads=reads,
        writes=writes,
    )


# reductions (aten names): their rows' length is their input's elements over their output's, or for the softmax
# family (whose output is its input's size) the size of the reduced dim
_REDUCTIONS = {
    "sum",
    "mean",
    "var",
    "var_mean",
    "std",
    "amax",
    "amin",
    "norm",
    "linalg_vector_norm",
    "logsumexp",
    "_fused_rms_norm",
    "native_layer_norm",
    "nll_loss_forward",
}
_SOFTMAX = {"_softmax", "_log_softmax", "_softmax_backward_data", "_log_softmax_backward_data"}


def _reduced(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """The length of the rows a reduction op reduces (0 for other ops)."""
    name = func.__name__.split(".")[0]
    if name in _SOFTMAX:
        x, dim = args[0], _arg(func, args, kwargs, "dim")
        ok = isinstance(x, torch.Tensor) and x.ndim and isinstance(dim, int)
        return int(x.shape[dim]) if ok else 0
    if name not in _REDUCTIONS:
        return 0
    if name in ("native_layer_norm", "_fused_rms_norm"):  # (input, normalized_shape, ...)
        return math.prod(args[1]) if len(args) > 1 else 0
    ins, outs = _tensors(args[:1]), _tensors(out)
    if not ins or not outs or outs[0].numel() == 0:
        return 0
    return max(0, ins[0].numel() // max(1, outs[0].numel()))


def _whole(func: Any, args: tuple[Any, ...], out: Any) -> bool:
    """Whether a reduction op reduces its whole input (more than one element) to one value: `torch.max(x)`,
    `x.sum()`, a norm, torchao's tensorwise amax."""
    name = func.__name__.split(".")[0]
    if name not in _REDUCTIONS and name not in ("max", "min"):
        return False
    ins, outs = _tensors(args[:1]), _tensors(out)
    return bool(ins and outs) and outs[0].numel() == 1 and ins[0].numel() > 1


def _grouped_shape(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int, int]:
    """(m, n, k, groups) of `torch._grouped_mm(a, b, offs)`: 2-D x 3-D (the experts' forward and input gradient:
    rows [M, K] by weights [G, K, N]), 2-D x 2-D (the weight gradient: [K, M] by [M, N], the contraction over M
    split into G groups, out [G, K, N]), 3-D x 3-D (a batched GEMM); m is the rows of one group (the mean)."""
    if a.ndim == 2 and b.ndim == 3:
        g = b.shape[0]
        return max(1, a.shape[0] // g), b.shape[-1], a.shape[-1], g
    if a.ndim == 2 and b.ndim == 2:
        return a.shape[0], b.shape[-1], a.shape[-1], 1  # groups: the caller's (the offsets')
    if a.ndim == 3 and b.ndim == 2:
        g = a.shape[0]
        return a.shape[1], max(1, b.shape[-1] // g), a.shape[-1], g
    return a.shape[-2], b.shape[-1], a.shape[-1], a.shape[0]


def grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> int:
    """FLOPs of `torch._grouped_mm(a, b, offs=...)` (torch's flop counter has no formula for it: 0), twice the
    multiply-adds of all its groups together.

    Example:
        >>> rows, w = torch.empty(64, 32), torch.empty(4, 32, 48)  # 4 experts, 16 rows each
        >>> grouped_mm_flops(rows, w) == 2 * 64 * 32 * 48
        True
    """
    if a.ndim == 2 and b.ndim == 2:
        return 2 * a.shape[0] * a.shape[1] * b.shape[1]
    m, n, k, g = _grouped_shape(a, b)
    return 2 * m * n * k * g


# formulas the dry run's FLOP count adds to torch's (`torch.utils.flop_counter.flop_registry`)
FLOP_FORMULAS: dict[Any, Any] = {
    torch.ops.aten._grouped_mm: grouped_mm_flops,
    torch.ops.aten._scaled_grouped_mm: grouped_mm_flops,  # (a, b, scale_a, scale_b, offs=...)
}


def grouped_mm_dtypes(device: DeviceSpec) -> tuple[torch.dtype, ...]:
    """The dtypes in which `device` (a row of the device table) runs `torch._grouped_mm`, as accelfn's platform
    for it would say on that device: bf16 on CUDA rows from compute capability 9.0, none elsewhere.

    Example:
        >>> from accelfn.platforms.specs import spec
        >>> grouped_mm_dtypes(spec("h100-sxm")), grouped_mm_dtypes(spec("a100-80gb"))
        ((torch.bfloat16,), ())
    """
    if device.kind != "cuda" or device.key in _NO_GROUPED_MM or not hasattr(torch, "_grouped_mm"):
        return ()
    return (torch.bfloat16,)


def _math_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul operand is multiplied in: a float8 training tensor's (torchao's
    `Float8TrainingTensor` reports its original dtype, its `_data` is fp8: its `mm` runs `_scaled_mm` inside
    the subclass, out of the tracker's sight), else its own."""
    data = getattr(x, "_data", None)
    if isinstance(data, torch.Tensor) and data.dtype.is_floating_point and data.element_size() == 1:
        return data.dtype
    return x.dtype


def cost_time(cost: OpCost, device: DeviceSpec, assumptions: TimingAssumptions) -> float:
    """Seconds of one kernel (no launch floor) on `device`: `matmul_time`, `attention_time` (fp32 attention at
    `fp32_attention_peak`, fp8 at the bf16 peak) or `eager_memory_time` (one op, one ATen kernel:
    a compiled region's fused kernels are `fused_time`'s)."""
    if cost.kind == "matmul":
        dtype = cost.dtype
        if peak_tflops(device, dtype) is None:
            # fp8 emulated on a device without fp8 (af.autocast_fp8's emulate=True) runs in bf16; integer and
            # fp64 matmuls have no row: priced at fp32's (else bf16's) peak
            dtype = torch.bfloat16 if dtype.itemsize == 1 else torch.float32
            if peak_tflops(device, dtype) is None:
                dtype = torch.bfloat16
        return matmul_time(
            cost.m,
            cost.n,
            cost.k,
            dtype,
            device,
            assumptions,
            batch=cost.batch,
            out_bytes=cost.out_bytes,
        )
    if cost.kind == "attention":
        # 1-byte floats at bf16's rate, fp64 at fp32's
        dtype = {1: torch.bfloat16, 2: cost.dtype}.get(cost.dtype.itemsize, torch.float32)
        return attention_time(
            cost.flops,
            device,
            assumptions,
            dtype,
            backward=cost.backward_kernel,
            seq=cost.seq,
            causal=cost.causal,
        )
    return eager_memory_time(cost.nbytes, device, assumptions)


class OpTimer(TorchDispatchMode):
    """Times every op run inside it (real or fake tensors) with the model of the module docs, into `times`.

    Example:
        >>> from accelfn.platforms.specs import spec
        >>> with OpTimer(spec("h100-sxm"), TimingAssumptions(launch_s=0.0)) as timer:
        ...     y = torch.ones(64, 32, dtype=torch.bfloat16) @ torch.ones(32, 16, dtype=torch.bfloat16)
        >>> timer.times.kernels, timer.times.seconds["matmul"] > 0
        (3, True)
    """

    def __init__(self, device: DeviceSpec, assumptions: TimingAssumptions | None = None) -> None:
        super().__init__()
        self.device = device
        self.assumptions = assumptions or TimingAssumptions()
        a = self.assumptions
        self.times = OpTimes(
            assumes={
                "gemm_efficiency": a.gemm(device),
                "fp8_gemm_efficiency": a.gemm(device, torch.float8_e4m3fn),
                "tiles": a.tiles,
                "sm_count": a.sms(device),
                "attention_efficiency": a.attention_efficiency,
                "attention_backend": a.backend(device),
                "torch_version": a.torch_version,
                "attention_by": f"{a.backend(device)}'s measured SDPA speed on H100 by direction, key length and "
                "causal mask",
                "memory_efficiency": a.memory_efficiency,
                "eager_memory_efficiency": a.eager_memory_efficiency,
                "reduction_efficiency": a.reduction_efficiency
                if a.reduction_efficiency is not None
                else "torch.compile's measured RMSNorm by reduced length (quack, H100)"
                + (f" x {a.reduction_scale:g}" if a.reduction_scale != 1.0 else ""),
                "reduction_scale": a.reduction_scale,
                "memory_gbs": device.memory_gbs,
                "launch_s": a.launch_s if a.eager else 0.0,
                "peaks": "fp8 matmuls (_scaled_mm) at the fp8 peak times fp8_gemm_efficiency; other ops at "
                "their operands' dtype's",
            }
        )

    def op_time(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> tuple[str, float]:
        """(kind, seconds) of one op, before the launch floor; ("", 0.0) for ops that launch no kernel and for
        collectives (the communication model times those)."""
        cost = op_cost(func, args, kwargs, out)
        if cost is None:
            return "", 0.0
        return cost.kind, cost_time(cost, self.device, self.assumptions)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind, seconds = self.op_time(func, args, kwargs, out)
        if kind:
            floor = self.assumptions.launch_s if self.assumptions.eager else 0.0
            if seconds < floor:
                self.times.launch_bound += 1
            self.times.seconds[kind] += max(seconds, floor)
            self.times.kernels += 1
        return out
