"""Which kernel torch's SDPA runs on a GPU for a torch version, and how fast each was measured on an H100
(issue 30): the dry run charges an attention kernel at the measured speed of the backend the run's torch picks.

torch's SDPA tries its backends in `priority_order` (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) and
runs the first that accepts the call; for bf16, head dim 128, causal, no mask all of them accept it on an H100,
so the order decides. On sm90 (H100, H200, GH200) and sm100 (B200, GB200) it was, by torch version:

- up to 2.4: FlashAttention-2 (cuDNN's kernel only with `TORCH_CUDNN_SDPA_ENABLED=1`: pytorch#125343, which made it
  the default on H100, was reverted for 2.4 by pytorch#128539);
- 2.5.0: cuDNN first ("cuDNN backend for SDPA ... enabled by default for H100", the 2.5 release blog; pytorch#138522:
  "Currently we have a `cudnn_order` that says on H100 w/ new enough CuDNN backend ... try to run CuDNN attention
  first");
- 2.5.1 to 2.8, and the main branch from 2024-10-22 to 2025-09-04 (the nightly of 2024-12-23, torch 1963fc8,
  that torchtitan's published Llama 3.1 runs used, included): FlashAttention-2. pytorch#138522 ("Make CuDNN
  Attention Opt in", merged 2024-10-22 and cherry-picked onto release/2.5 as critical) put cuDNN last:
  `default_order{flash_attention, efficient_attention, math, cudnn_attention}`; pytorch#142132 (nightly
  2.6.0.dev20241204 on an H100: "SDPA is not automatically choosing CUDNN impl", answered "This is expected");
- 2.9: cuDNN first again on sm90 / sm100 (pytorch#162073, "Enable cuDNN SDPA by default for SM 9.0, SM 10.0",
  "for 2.9": `CUDNN_VERSION >= 90900` at build time, `TORCH_CUDNN_SDPA_PREFERRED=0` to opt out);
- 2.10: cuDNN first only where the runtime cuDNN is newer than 9.15.0 (pytorch#171627 and #169849:
  `cudnn_version > 91500`, `TORCH_CUDNN_SDPA_DEPRIORITIZED=1` to opt out), which 2.10's wheels do not bundle
  (huggingface/transformers#48163: "that code is already in 2.10. What changes at 2.11 is the bundled cuDNN
  crossing the threshold"): FlashAttention-2;
- 2.11 and later: cuDNN (the same rule; 2.11's wheels bundle cuDNN 9.19, 2.13's 9.20: pytorch#193893; this
  project's H100 profile of torch 2.11.0+cu130 ran `cudnn_generated_fort_native_sdpa_sm90_flash_{fprop,bprop}`).

Other GPUs (sm80 and the rest) run FlashAttention-2 in every version. Not modelled: a cuDNN installed apart from
the wheel (it moves 2.10's answer), the opt-out variables, and calls cuDNN refuses (it then falls to the next).

Example:
    >>> sdpa_backend("2.6.0.dev20241223", "h100-96gb"), sdpa_backend("2.11.0+cu130", "h100-sxm")
    ('flash2', 'cudnn')
    >>> sdpa_backend("2.11.0", "a100-80gb")
    'flash2'
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = [
    "BACKENDS",
    "FA2_H100_TFLOPS",
    "FA2_H100_CAUSAL_TFLOPS",
    "CUDNN_H100_TFLOPS",
    "CUDNN_H100_CAUSAL_TFLOPS",
    "sdpa_backend",
    "speeds",
]

BACKENDS = ("flash2", "cudnn")

# FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608) measured FlashAttention-2 and cuDNN's SDPA side by side on an
# H100 80GB SXM5 (bf16/fp16, head dim 128), TFLOP/s by sequence length 512 ... 16k (the backward counted as 2.5
# forwards; causal: the FLOPs of the computed half): figure "Attention forward speed, head dim 128" without
# (5c) and with (5d) a causal mask, and "Attention backward speed, head dim 128" (no causal mask; the paper has no
# causal backward figure). FlashAttention-2, "achieving only 35% utilization on the H100" (abstract):
FA2_H100_TFLOPS: Mapping[int, tuple[float, float]] = {
    512: (309.0, 214.0),
    1024: (350.0, 260.0),
    2048: (362.0, 291.0),
    4096: (368.0, 310.0),
    8192: (370.0, 318.0),
    16384: (370.0, 322.0),
}
_FA2_H100_CAUSAL_FORWARD: Mapping[int, float] = {
    512: 191.0,
    1024: 260.0,
    2048: 298.0,
    4096: 319.0,
    8192: 333.0,
    16384: 335.0,
}
# cuDNN's SDPA in the same figures (non-causal forward at 512: 497, read as cuDNN's bar; some readings of the
# figure swap it with FlashAttention-3's 467):
CUDNN_H100_TFLOPS: Mapping[int, tuple[float, float]] = {
    512: (497.0, 305.0),
    1024: (574.0, 408.0),
    2048: (617.0, 465.0),
    4096: (609.0, 499.0),
    8192: (600.0, 518.0),
    16384: (595.0, 516.0),
}
_CUDNN_H100_CAUSAL_FORWARD: Mapping[int, float] = {
    512: 315.0,
    1024: 410.0,
    2048: 484.0,
    4096: 518.0,
    8192: 529.0,
    16384: 539.0,
}


def _causal(
    table: Mapping[int, tuple[float, float]], forward: Mapping[int, float]
) -> dict[int, tuple[float, float]]:
    """With a causal mask: the measured forward; the backward *assumed* to slow as the forward does at the same
    length (the causal / non-causal forward ratio times the measured non-causal backward)."""
    return {n: (fwd, table[n][1] * fwd / table[n][0]) for n, fwd in forward.items()}


# FlashAttention-2's own H100 figure for forward + backward (Dao-AILab/flash-attention
# assets/flash2_h100_fwd_bwd_benchmark.png, 2023, head dim 128) bounds the assumed causal backward: its causal /
# non-causal ratio for the pair is 0.66 / 0.75 / 0.83 / 0.90 / 0.92 / 0.97, the assumption's 0.62 / 0.74 / 0.82 /
# 0.87 / 0.90 / 0.91.
FA2_H100_CAUSAL_TFLOPS: Mapping[int, tuple[float, float]] = _causal(FA2_H100_TFLOPS, _FA2_H100_CAUSAL_FORWARD)
# cuDNN's, the same assumption: 484 / 365 TFLOP/s at 2k. This project's H100 profile (torch 2.11.0+cu130, a newer
# cuDNN than the paper's, 0.9B Llama at 2k causal) measured 536 forward and 484 backward: the table is 10% slow on
# the forward and the assumed causal backward 25% slow (the measurement is one row's own run: not taken as the table).
CUDNN_H100_CAUSAL_TFLOPS: Mapping[int, tuple[float, float]] = _causal(
    CUDNN_H100_TFLOPS, _CUDNN_H100_CAUSAL_FORWARD
)

_TABLES = {
    ("flash2", False): FA2_H100_TFLOPS,
    ("flash2", True): FA2_H100_CAUSAL_TFLOPS,
    ("cudnn", False): CUDNN_H100_TFLOPS,
    ("cudnn", True): CUDNN_H100_CAUSAL_TFLOPS,
}

# device rows with compute capability 9.0 or 10.0, where torch may prefer cuDNN (`check_prefer_cudnn_attention`)
_CUDNN_PREFERRED_ROWS = {
    "h100-sxm",
    "h100-96gb",
    "h100-pcie",
    "h100-nvl",
    "h200-sxm",
    "h200-nvl",
    "gh200",
    "b200",
    "gb200",
}
# the main branch's order by date, for nightlies (YYYYMMDD): FlashAttention-2 from pytorch#138522 to pytorch#162073
_MAIN_FLASH2 = (20241022, 20250904)
_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?(?:\.?(?:dev|a0|a|b|rc)(\d+)?)?")


def speeds(backend: str, causal: bool = False) -> Mapping[int, tuple[float, float]]:
    """The measured (forward, backward) TFLOP/s of `backend`'s SDPA kernel on an H100 by key length.

    Example:
        >>> fwd, bwd = speeds("cudnn", causal=True)[2048]
        >>> fwd, round(bwd)
        (484.0, 365)
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {backend!r}")
    return _TABLES[(backend, causal)]


def sdpa_backend(torch_version: str, device_key: str) -> str:
    """The SDPA backend (`"flash2"` or `"cudnn"`) torch `torch_version` (`torch.__version__`'s form: "2.11.0+cu130",
    a nightly's "2.6.0.dev20241223") runs for bf16, head dim 128, causal attention on the device row `device_key`
    (see the module docs for the sources).

    Example:
        >>> [sdpa_backend(v, "h100-sxm") for v in ("2.4.1", "2.5.0", "2.5.1", "2.9.0", "2.10.0", "2.12.0")]
        ['flash2', 'cudnn', 'flash2', 'cudnn', 'flash2', 'cudnn']
    """
    m = _VERSION.match(torch_version.strip())
    if m is None:
        raise ValueError(
            f"torch_version {torch_version!r} is not a torch version (e.g. '2.11.0', '2.6.0.dev20241223')"
        )
    if device_key not in _CUDNN_PREFERRED_ROWS:
        return "flash2"
    major, minor, patch = int(m[1]), int(m[2]), int(m[3] or 0)
    dev = m[4]
    version = (major, minor)
    if (
        dev is not None and len(dev) == 8 and (2, 6) <= version <= (2, 9)
    ):  # a main-branch nightly: that day's order
        return "flash2" if _MAIN_FLASH2[0] <= int(dev) < _MAIN_FLASH2[1] else "cudnn"
    if (
        version < (2, 5)
        or (version == (2, 5) and patch >= 1)
        or (2, 6) <= version <= (2, 8)
        or version == (2, 10)
    ):
        return "flash2"
    return "cudnn"
