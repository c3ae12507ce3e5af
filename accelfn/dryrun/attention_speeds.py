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
- 2.9: cuDNN first where the build's cuDNN is 9.9 or newer (pytorch#162073, "Enable cuDNN SDPA by default for
  SM 9.0, SM 10.0", "for 2.9": `CUDNN_VERSION >= 90900` at build time, `TORCH_CUDNN_SDPA_PREFERRED=0` to opt
  out): the CUDA 12.9 and 13.0 wheels (built with cuDNN 9.10.2 and 9.13: pytorch#154980, #162268); not the CUDA
  12.8 wheels, PyPI's default, which CI built against cuDNN 9.8.0 (pytorch#165801: "cuDNN wasn't being selected
  as the default backend for SDPA where expected ... the wheel build checks cuDNN version at compile time (9.8)"):
  FlashAttention-2;
- 2.10: cuDNN first only where the runtime cuDNN is newer than 9.15.0 (pytorch#171627 for #169849, cherry-picked
  onto release/2.10 by #171895; titled "off-by-default for cuda versions < 12.9", its code gates on the runtime
  cuDNN: `cudnn_version > 91500`, `TORCH_CUDNN_SDPA_DEPRIORITIZED=1` to opt out): the CUDA
  13.0 wheels, which bundle cuDNN 9.15.1 (pytorch#171189, the cherry-pick of #169412); the CUDA 12.x wheels
  bundle 9.10.2 (huggingface/transformers#48163: "that code is already in 2.10. What changes at 2.11 is the
  bundled cuDNN crossing the threshold"): FlashAttention-2;
- 2.11 and later: cuDNN (the same rule; 2.11's wheels bundle cuDNN 9.19: pytorch#175672, 2.13's 9.20:
  pytorch#193893; this project's H100 profile of torch 2.11.0+cu130 ran
  `cudnn_generated_fort_native_sdpa_sm90_flash_{fprop,bprop}`).

A nightly (`2.10.0.dev20251015+cu128`) follows the main branch on its date (`MAIN_BRANCH`): cuDNN first before
pytorch#138522 (merged 2024-10-22), FlashAttention-2 from it, from pytorch#162073 (merged 2025-09-04) the build's
cuDNN as for 2.9, from pytorch#171627 (opened 2026-01-02, on main by 2026-01-07, when its cherry-pick #171895 was
opened) the bundled cuDNN as for 2.10, which reached 9.15.1 on CUDA 13.0 before 2025-12-23 (pytorch#169412, whose
cherry-pick #171189 is of that date) and on CUDA 12.8 on 2026-01-17 (pytorch#172680). A nightly's own date
counts as after a change merged that day (the build of that day may predate it). A version without a CUDA tag
(`+cu128`, `+cu130`) is taken as the CUDA 12.8 build (PyPI's wheel of 2.9 and 2.10); other CUDA 12 builds as
12.8, except 12.9 before pytorch#171627.

Other GPUs (sm80 and the rest) run FlashAttention-2 in every version. Not modelled: a cuDNN installed apart from
the wheel (it moves 2.10's answer), builds other than pytorch.org's wheels (NGC's containers, source builds), the
opt-out variables, and calls cuDNN refuses (it then falls to the next).

Example:
    >>> sdpa_backend("2.6.0.dev20241223", "h100-96gb"), sdpa_backend("2.11.0+cu130", "h100-sxm")
    ('flash2', 'cudnn')
    >>> sdpa_backend("2.11.0", "a100-80gb")
    'flash2'
    >>> [sdpa_backend(v, "h100-sxm") for v in ("2.9.0.dev20250801", "2.10.0.dev20251015+cu130", "2.10.0+cu130")]
    ['flash2', 'cudnn', 'cudnn']
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = [
    "BACKENDS",
    "MAIN_BRANCH",
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
# The main branch's changes to the order on sm90 / sm100, by merge date (YYYYMMDD), for nightlies: see the module docs.
MAIN_BRANCH: Mapping[str, int] = {
    "pytorch#138522 cuDNN opt in": 20241022,
    "pytorch#162073 cuDNN first where built with cuDNN >= 9.9": 20250904,
    "pytorch#171627 cuDNN first where the runtime cuDNN > 9.15.0": 20260107,
    "pytorch#172680 CUDA 12.8 builds bundle cuDNN 9.15.1": 20260117,
}
_OPT_IN, _BUILT_WITH, _RUNTIME, _CU128_CUDNN_9_15 = MAIN_BRANCH.values()
# release[.devYYYYMMDD | aN | bN | rcN][+local], whole: a nightly's date has 8 digits, its CUDA tag follows a "+"
_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?(?:\.?dev(\d{8})|(?:a|b|rc)\d+)?(?:\+([\w.]+))?$")
_CUDA_TAG = re.compile(r"^cu(\d+?)(\d)$")  # "cu128" -> CUDA 12.8, "cu130" -> 13.0


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
        >>> [sdpa_backend(v, "h100-sxm") for v in ("2.4.1", "2.5.0", "2.5.1", "2.9.0", "2.9.0+cu130", "2.12.0")]
        ['flash2', 'cudnn', 'flash2', 'flash2', 'cudnn', 'cudnn']
    """
    m = _VERSION.match(torch_version.strip())
    if m is None:
        raise ValueError(
            f"torch_version {torch_version!r} is not a torch version (e.g. '2.11.0', '2.6.0.dev20241223')"
        )
    if device_key not in _CUDNN_PREFERRED_ROWS:
        return "flash2"
    major, minor, patch = int(m[1]), int(m[2]), int(m[3] or 0)
    dev, version = m[4], (major, minor)
    tag = _CUDA_TAG.match(m[5] or "")
    cuda = (int(tag[1]), int(tag[2])) if tag else (12, 8)  # no tag: the CUDA 12.8 wheel
    if dev is not None and len(dev) == 8 and version >= (2, 6):  # a main-branch nightly: that day's order
        return _main_branch(int(dev), cuda)
    if version < (2, 5) or (version == (2, 5) and patch >= 1) or (2, 6) <= version <= (2, 8):
        return "flash2"
    # 2.9: built with cuDNN >= 9.9: CUDA 12.9 (9.10.2) and 13.x (9.13); 12.8 built with 9.8.0
    if version == (2, 9):
        return "cudnn" if cuda >= (12, 9) else "flash2"
    if version == (2, 10):  # runtime cuDNN > 9.15.0: CUDA 13.0 wheels (9.15.1); 12.x bundle 9.10.2
        return "cudnn" if cuda >= (13, 0) else "flash2"
    return "cudnn"


def _main_branch(date: int, cuda: tuple[int, int]) -> str:
    """The backend of the main branch's nightly of `date` (YYYYMMDD) built for CUDA `cuda` (see MAIN_BRANCH)."""
    if date < _OPT_IN:
        return "cudnn"
    if date < _BUILT_WITH:
        return "flash2"
    if date < _RUNTIME:  # the build's cuDNN >= 9.9: CUDA 12.9 (9.10.2), 13.x (9.13); 12.8 built with 9.8.0
        return "cudnn" if cuda >= (12, 9) else "flash2"
    # the bundled cuDNN > 9.15.0: CUDA 13.x from before pytorch#171627, other CUDA 12 builds from pytorch#172680
    return "cudnn" if cuda >= (13, 0) or date >= _CU128_CUDNN_9_15 else "flash2"
