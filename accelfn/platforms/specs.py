"""The device table: data-sheet figures of accelerators, the one source for `af.Meter`'s MFU and `accelfn dry-run`.

Each `DeviceSpec` row holds the dense (no 2:4 sparsity) peak TFLOP/s per matmul dtype, device memory, memory
bandwidth, the bandwidth to the other devices of a node and to the network, and the vendor page the figures
come from. `spec(name)` finds a row by its key, a loose alias (`"h100"`, `"v5p"`) or a torch device name;
`find(device_name)` matches torch device names only (`torch.cuda.get_device_name()`); `peak_tflops(row, dtype)`
reads the figure a matmul in `dtype` runs at. `Platform.peak_tflops` (so `af.Meter`) reads this table for
the cuda kind (NVIDIA and ROCm), xla (TPUs, by PJRT device kind) and the other `torch.cuda`-like kinds.

Figures are per device. `memory_gib` is GiB: vendors write HBM and GDDR capacity as "GB", but the memory
is binary-sized (an H100's "80GB" is five 16 GiB stacks, 85.9e9 bytes; torch reports a little less, what
ECC and the driver keep back). Bandwidths are GB/s (1e9 bytes/s), one direction: `memory_gbs` to device
memory, `intra_node_gbs` to all peers in the node together (NVLink/NVSwitch, Infinity Fabric, Gaudi's
on-chip RoCE ports, TPU ICI; PCIe x16 for PCIe cards, whose NVLink bridges join only pairs or fours),
`inter_node_gbs` the share of one device of a typical node's network (e.g. one 400 Gb/s NIC per GPU = 50 GB/s).

Example:
    >>> import torch
    >>> from accelfn.platforms import specs
    >>> h100 = specs.spec("h100")
    >>> h100.key, h100.tflops["bf16"], h100.memory_gib, h100.devices_per_node
    ('h100-sxm', 989.0, 80.0, 8)
    >>> specs.find("NVIDIA H100 PCIe").key, specs.find("AMD Instinct MI300X").key
    ('h100-pcie', 'mi300x')
    >>> specs.peak_tflops("tpu-v5p", torch.bfloat16)
    459.0
"""

from __future__ import annotations

import re
import types
from collections.abc import Mapping

import attrs
import torch

__all__ = ["DeviceSpec", "DEVICES", "TFLOPS_KEYS", "spec", "find", "peak_tflops"]

TFLOPS_KEYS: tuple[str, ...] = ("fp32", "tf32", "bf16", "fp16", "fp8")
"""The dtype keys of `DeviceSpec.tflops`: fp32 (no tensor-core TF32), tf32, bf16, fp16, fp8 (any 1-byte float)."""


def _frozen_tflops(value: Mapping[str, float]) -> Mapping[str, float]:
    unknown = set(value) - set(TFLOPS_KEYS)
    if unknown:
        raise ValueError(f"DeviceSpec.tflops: unknown keys {sorted(unknown)}; the keys are {TFLOPS_KEYS}")
    return types.MappingProxyType({k: float(value[k]) for k in TFLOPS_KEYS if k in value})


@attrs.frozen
class DeviceSpec:
    """One accelerator's data-sheet figures (see the module docs for the units and assumptions).

    Example:
        >>> from accelfn.platforms.specs import spec
        >>> a100 = spec("a100-40gb")
        >>> a100.name, a100.memory_bytes == 40 * 2**30, "fp8" in a100.tflops
        ('NVIDIA A100 40GB SXM', True, False)
    """

    key: str
    """Short id, lower case (`"h100-sxm"`), what `spec()` and `accelfn dry-run --gpu` take."""
    name: str
    """Human name."""
    kind: str
    """The accelfn platform kind that runs it: `"cuda"` (NVIDIA, and AMD GPUs, which ROCm torch serves through
    `torch.cuda`), `"xla"` (TPUs), `"cpu"`; `"hpu"` (Intel Gaudi) is no accelfn kind: its row is for reports."""
    pattern: str
    """Regular expression searched in a torch device name (`torch.cuda.get_device_name()`, torch_xla's device
    kind); `""` when none. `find` takes the first row that matches, so specific rows come first."""
    tflops: Mapping[str, float] = attrs.field(converter=_frozen_tflops, hash=False)
    """Dense peak TFLOP/s by dtype key (`TFLOPS_KEYS`); a key the vendor does not publish is left out."""
    memory_gib: float
    """Device memory in GiB (the vendor's "GB" figure: see the module docs)."""
    memory_gbs: float
    """Memory bandwidth, GB/s."""
    intra_node_gbs: float
    """Bandwidth to the other devices of the node, GB/s per direction (all links together)."""
    inter_node_gbs: float
    """This device's share of a typical node's network bandwidth, GB/s per direction."""
    devices_per_node: int
    """Devices in a typical node (host)."""
    source: str
    """The vendor page the figures come from (`""` for the nominal cpu row)."""
    power_w: float | None = None
    """The board power limit (W) the figures assume, where the part is run at more than one and the limit sets
    its clocks (B200 at 1000 W in HGX, 1200 W in GB200); None where the vendor sells one configuration."""

    @property
    def memory_bytes(self) -> int:
        """`memory_gib` in bytes."""
        return int(self.memory_gib * 2**30)


# NVIDIA data sheets mark sparse tensor figures with an asterisk: the figures here are half of those. fp32 is
# the CUDA-core figure (fp32 matmuls under torch's default "highest" precision), fp16 equals bf16 on tensor cores.
# Networks: SXM nodes have one 400 Gb/s NIC per GPU (DGX/HGX H100, H200, B200: 8x ConnectX-7), A100 nodes one
# 200 Gb/s NIC per GPU (DGX A100); PCIe servers follow NVIDIA's 2-8-5-200 reference (four 200 Gb/s east-west
# NICs for 8 GPUs: 100 Gb/s = 12.5 GB/s per GPU). PCIe cards reach their peers over PCIe x16 (Gen5: 64 GB/s,
# Gen4: 32 GB/s per direction); their NVLink bridges (H100 NVL: pairs, 600 GB/s; H200 NVL: up to four, 900 GB/s
# both directions together) are left out, since they do not join all the cards of a node.
_NVLINK4 = 450.0  # NVLink 4, 18 links: 900 GB/s both directions
_PCIE5, _PCIE4 = 64.0, 32.0
_NIC400, _NIC200, _PCIE_SERVER_NIC = 50.0, 25.0, 12.5

DEVICES: tuple[DeviceSpec, ...] = (
    # GB200: two Blackwell GPUs and a Grace CPU per superchip, the figures per GPU (NVIDIA prints them per
    # superchip and per rack: halved, then halved again for sparsity). In an NVL72 rack NVLink 5 joins all 72
    # GPUs, across its 18 compute trays (hosts) of 4 GPUs; one 400 Gb/s NIC per GPU to the network.
    DeviceSpec(
        key="gb200",
        name="NVIDIA GB200 (NVL72, per GPU)",
        kind="cuda",
        pattern=r"\bGB200\b",  # "NVIDIA GB200"
        tflops={"fp32": 90.0, "tf32": 1250.0, "bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0},
        memory_gib=186.0,  # NVL72: 13.4 TB HBM3e for 72 (372 GB per superchip)
        memory_gbs=8000.0,
        intra_node_gbs=900.0,  # NVLink 5: 1.8 TB/s both directions, to all 72 GPUs of the rack
        inter_node_gbs=_NIC400,
        devices_per_node=4,
        source="https://www.nvidia.com/en-us/data-center/gb200-nvl72/",
        power_w=1200.0,
    ),
    DeviceSpec(
        key="b200",
        name="NVIDIA B200 (HGX)",
        kind="cuda",
        pattern=r"\bB200",  # not GB200, which runs faster
        tflops={"fp32": 75.0, "tf32": 1125.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
        memory_gib=180.0,  # HGX B200: 1.4 TB for 8
        memory_gbs=8000.0,
        intra_node_gbs=900.0,  # NVLink 5: 1.8 TB/s both directions
        inter_node_gbs=_NIC400,
        devices_per_node=8,
        source="https://www.nvidia.com/en-us/data-center/hgx/",
        power_w=1000.0,
    ),
    DeviceSpec(
        key="h200-nvl",
        name="NVIDIA H200 NVL",
        kind="cuda",
        pattern=r"\bH200 NVL",
        tflops={"fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0, "fp8": 1670.0},
        memory_gib=141.0,
        memory_gbs=4800.0,
        intra_node_gbs=_PCIE5,
        inter_node_gbs=_PCIE_SERVER_NIC,
        devices_per_node=8,
        source="https://www.nvidia.com/en-us/data-center/h200/",
    ),
    DeviceSpec(
        key="h200-sxm",
        name="NVIDIA H200 SXM",
        kind="cuda",
        pattern=r"\bH200",  # not GH200
        tflops={"fp32": 67.0, "tf32": 494.7, "bf16": 989.0, "fp16": 989.0, "fp8": 1979.0},
        memory_gib=141.0,
        memory_gbs=4800.0,
        intra_node_gbs=_NVLINK4,
        inter_node_gbs=_NIC400,
        devices_per_node=8,
        source="https://www.nvidia.com/en-us/data-center/h200/",
    ),
    DeviceSpec(
        key="h100-nvl",
        name="NVIDIA H100 NVL",
        kind="cuda",
        pattern=r"\bH100 NVL",
        tflops={"fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0, "fp8": 1670.0},
        memory_gib=94.0,
        memory_gbs=3900.0,
        intra_node_gbs=_PCIE5,
        inter_node_gbs=_PCIE_SERVER_NIC,
        devices_per_node=8,
        source="https://www.nvidia.com/en-us/data-center/h100/",
    ),
    DeviceSpec(
        key="h100-pcie",
        name="NVIDIA H100 PCIe",
        kind="cuda",
        pattern=r"\bH100 PCIe",
        tflops={"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0},
        memory_gib=80.0,
        memory_gbs=2000.0,
        intra_node_gbs=_PCIE5,
        inter_node_gbs=_PCIE_SERVER_NIC,
        devices_per_node=8,
        source="https://www.nvidia.com/en-us/data-center/h100/",
    ),
    # The H100 SXM with six 16 GiB stacks of HBM2e (2.4 TB/s) that Meta's Grand Teton hosts carry, run at its
    # default 500 W limit (up to 700 W): the part torchtitan's published benchmarks ran on
    # (benchmarks/llama3_h100_202412_torchtitan.md). NVIDIA publishes no data sheet for it; it reports itself as
    # plain "NVIDIA H100" (pytorch/torchtitan#554); torchtitan: "the actual peak TFLOPs number is between SXM and
    # NVL, and we don't know its exact value". The same 132-SM die is rated 989 dense bf16 TFLOP/s at 700 W (H100
    # SXM) and 835 at 350-400 W (H100 NVL), both on NVIDIA's H100 data sheet: the tensor cores' clock falls with
    # the power limit. Its peaks here are those two ratings interpolated linearly in the power limit at 500 W
    # (400 W -> 835, 700 W -> 989: 886 bf16; fp8 1,773, tf32 and fp32 alike): an assumption between two published
    # figures, not a measurement of this part. Memory bandwidth is its HBM2e's, which the power limit leaves. Its
    # large GEMMs were measured at 585 bf16 TFLOP/s at 500 W (pytorch/FBGEMM#2546): accelfn.dryrun.timing.MAMF.
    DeviceSpec(
        key="h100-96gb",
        name="NVIDIA H100 96GB HBM2e (SXM, 500 W)",
        kind="cuda",
        pattern=r"^NVIDIA H100$",
        tflops={"fp32": 62.3, "tf32": 443.2, "bf16": 886.3, "fp16": 886.3, "fp8": 1773.0},
        memory_gib=96.0,
        memory_gbs=2400.0,
        intra_node_gbs=_NVLINK4,
        inter_node_gbs=_NIC400,
        devices_per_node=8,
        source="https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md",
        power_w=500.0,
    ),
    DeviceSpec(
        key="h100-sxm",
        name="NVIDIA H100 SXM",
        kind="cuda",
        pattern=r"\bH100",  # "NVIDIA H100 80GB HBM3"
        tflops={"fp32": 67.0, "tf32": 494.7, "bf16": 989.0, "fp16": 989.0, "fp8": 1979.0},
        memory_gib=80.0,
        memory_gbs=3350.0,
        intra_node_gbs=_NVLINK4,
        inter_node_gbs=_NIC400,
        devices_per_node=8,
        source="https://www.nvidia.com/en-us/data-center/h100/",
        power_w=700.0,
    ),
    DeviceSpec(
        key="a100-40gb",
        name="NVIDIA A100 40GB SXM",
        kind="cuda",
        pattern=r"\bA100\b.*\b40GB",  # "NVIDIA A100-SXM4-40GB" (and the PCIe card: the same compute)
        tflops={"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
        memory_gib=40.0,
        memory_gbs=1555.0,
        intra_node_gbs=300.0,  # NVLink 3: 600 GB/s both directions
        inter_node_gbs=_NIC200,
        devices_per_node=8,
        source="https://www.nvidia.com/en-us/data-center/a100/",
    ),
    DeviceSpec(
        key="a100-80gb",
        name="NVIDIA A100 80GB SXM",
        kind="cuda",
        pattern=r"\bA100\b",  # "NVIDIA A100-SXM4-80GB"
        tflops={"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
        memory_gib=80.0,
        memory_gbs=2039.0,
        intra_node_gbs=300.0,
        inter_node_gbs=_NIC200,
        devices_per_node=8,
        source="https://www.nvidia.com/en-us/data-center/a100/",
    ),
    DeviceSpec(
        key="l40s",
        name="NVIDIA L40S",
        kind="cuda",
        pattern=r"\bL40S\b",
        tflops={"fp32": 91.6, "tf32": 183.0, "bf16": 362.0, "fp16": 362.0, "fp8": 733.0},
        memory_gib=48.0,
        memory_gbs=864.0,
        intra_node_gbs=_PCIE4,
        inter_node_gbs=_PCIE_SERVER_NIC,
        devices_per_node=8,
        source="https://www.nvidia.com/en-us/data-center/l40s/",
    ),
    DeviceSpec(
        key="l4",
        name="NVIDIA L4",
        kind="cuda",
        pattern=r"\bL4\b",
        tflops={"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.0},
        memory_gib=24.0,
        memory_gbs=300.0,
        intra_node_gbs=_PCIE4,
        inter_node_gbs=_PCIE_SERVER_NIC,
        devices_per_node=8,
        source="https://www.nvidia.com/en-us/data-center/l4/",
    ),
    DeviceSpec(
        key="a10g",
        name="NVIDIA A10G",
        kind="cuda",
        pattern=r"\bA10G\b",
        # AWS's variant of the A10, which has no data sheet of its own: these are the A10's figures
        tflops={"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
        memory_gib=24.0,
        memory_gbs=600.0,
        intra_node_gbs=_PCIE4,
        inter_node_gbs=_PCIE_SERVER_NIC,
        devices_per_node=8,
        source="https://www.nvidia.com/en-us/data-center/products/a10-gpu/",
    ),
    # AMD: matrix-core figures (fp32 too: CDNA 3 and 4 run fp32 matmuls on their matrix cores). Seven Infinity
    # Fabric links join each GPU to the 7 others of the node (MI300X/MI325X: 64 GB/s per direction each; MI355X:
    # 76.8); nodes have one 400 Gb/s NIC per GPU. ROCm torch names them "AMD Instinct MI300X".
    # MI355X: 256 CUs at 2.4 GHz at its 1400 W board power (liquid cooled; the MI350X is the same chip at 1000 W
    # and 2.2 GHz). CDNA 4 has no TF32: AMD publishes no tf32 figure, so fp32 under TF32 precision reads None.
    DeviceSpec(
        key="mi355x",
        name="AMD Instinct MI355X",
        kind="cuda",
        pattern=r"\bMI355X\b",
        tflops={"fp32": 157.3, "bf16": 2516.6, "fp16": 2516.6, "fp8": 5033.2},
        memory_gib=288.0,
        memory_gbs=8000.0,
        intra_node_gbs=537.6,  # 7 x 153.6 GB/s both directions
        inter_node_gbs=_NIC400,
        devices_per_node=8,
        source="https://www.amd.com/en/products/accelerators/instinct/mi350/mi355x.html",
        power_w=1400.0,
    ),
    DeviceSpec(
        key="mi325x",
        name="AMD Instinct MI325X",
        kind="cuda",
        pattern=r"\bMI325X\b",
        tflops={"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9},
        memory_gib=256.0,
        memory_gbs=6000.0,
        intra_node_gbs=448.0,
        inter_node_gbs=_NIC400,
        devices_per_node=8,
        source="https://www.amd.com/en/products/accelerators/instinct/mi300/mi325x.html",
    ),
    DeviceSpec(
        key="mi300x",
        name="AMD Instinct MI300X",
        kind="cuda",
        pattern=r"\bMI300X\b",
        tflops={"fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4, "fp8": 2614.9},
        memory_gib=192.0,
        memory_gbs=5300.0,
        intra_node_gbs=448.0,
        inter_node_gbs=_NIC400,
        devices_per_node=8,
        source="https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html",
    ),
    # Intel Gaudi 3 (OAM): 24 on-chip 200 GbE RoCE ports; in an 8-card node 21 join the 7 peers (3 each) and 3 go
    # to the network. Intel publishes only the matrix-engine bf16/fp8 figures. No accelfn kind runs it.
    DeviceSpec(
        key="gaudi3",
        name="Intel Gaudi 3",
        kind="hpu",
        pattern=r"(?i)\bgaudi[ -]?3\b",  # torch.hpu.get_device_name(): "GAUDI3"
        tflops={"bf16": 1835.0, "fp8": 1835.0},
        memory_gib=128.0,
        memory_gbs=3700.0,
        intra_node_gbs=525.0,  # 21 x 200 Gb/s
        inter_node_gbs=75.0,  # 3 x 200 Gb/s
        devices_per_node=8,
        source="https://habana.ai/products/gaudi3/",
    ),
    # Google lists ICI bandwidth both directions together (halved here) and the data-center network per chip or
    # per host. ICI joins every chip of a slice, across hosts too; the network (DCN) joins slices. torch_xla's
    # device kind names them: "TPU v5 lite" (v5e), "TPU v5" (v5p).
    DeviceSpec(
        key="tpu-v5p",
        name="Google TPU v5p",
        kind="xla",
        pattern=r"\bTPU v5p?$",
        tflops={"bf16": 459.0, "fp8": 459.0},
        memory_gib=95.0,
        memory_gbs=2765.0,
        intra_node_gbs=600.0,  # ICI: 1200 GB/s both directions
        inter_node_gbs=6.25,  # DCN: 50 Gb/s per chip
        devices_per_node=4,
        source="https://cloud.google.com/tpu/docs/v5p",
    ),
    DeviceSpec(
        key="tpu-v5e",
        name="Google TPU v5e",
        kind="xla",
        pattern=r"\bTPU v5( lite|e)\b",
        tflops={"bf16": 197.0},
        memory_gib=16.0,
        memory_gbs=819.0,
        intra_node_gbs=200.0,  # ICI: 400 GB/s both directions
        inter_node_gbs=3.125,  # DCN: 2 x 100 Gb/s per 8-chip host
        devices_per_node=8,
        source="https://cloud.google.com/tpu/docs/v5e",
    ),
    # Nominal round figures for tests and CPU dry runs, measured on nothing; no pattern, so no platform reads it
    # (the cpu platform reports no peak, hence no MFU).
    DeviceSpec(
        key="cpu",
        name="CPU (nominal)",
        kind="cpu",
        pattern="",
        tflops={"fp32": 1.0, "bf16": 1.0},
        memory_gib=64.0,
        memory_gbs=100.0,
        intra_node_gbs=10.0,
        inter_node_gbs=10.0,
        devices_per_node=8,
        source="",
    ),
)

_VENDOR = re.compile(r"^(nvidia|amdinstinct|amd|instinct|intel|habana|google|cloud)+")


def _squash(name: str) -> str:
    return _VENDOR.sub("", re.sub(r"[^a-z0-9]", "", name.lower()))


_ALIASES: dict[str, str] = {
    "h100": "h100-sxm",
    "h100sxm5": "h100-sxm",
    "h10096gbhbm2e": "h100-96gb",
    "h100hbm2e": "h100-96gb",
    "h200": "h200-sxm",
    "a100": "a100-80gb",
    "v5p": "tpu-v5p",
    "v5e": "tpu-v5e",
    "v5lite": "tpu-v5e",
    "tpuv5lite": "tpu-v5e",
    "v5litepod": "tpu-v5e",
    "hl325l": "gaudi3",
}
_BY_NAME: dict[str, DeviceSpec] = {_squash(d.key): d for d in DEVICES}
_BY_NAME.update({alias: _BY_NAME[_squash(key)] for alias, key in _ALIASES.items()})


def find(device_name: str) -> DeviceSpec | None:
    """The first row whose `pattern` matches a torch device name, or None (keys and aliases are not matched).

    Example:
        >>> from accelfn.platforms.specs import find
        >>> find("NVIDIA H100 80GB HBM3").key, find("NVIDIA H200 NVL").key, find("TPU v5 lite").key
        ('h100-sxm', 'h200-nvl', 'tpu-v5e')
        >>> find("NVIDIA GeForce GT 710") is None
        True
    """
    for row in DEVICES:
        if row.pattern and re.search(row.pattern, device_name):
            return row
    return None


def spec(name: str) -> DeviceSpec:
    """The row for a key (`"h100-sxm"`), a loose form of one (case, spaces and a vendor prefix do not count:
    `"H100 PCIe"`, `"AMD MI300X"`, `"TPU v5p"`), an alias (`"h100"` -> h100-sxm, `"a100"` -> a100-80gb, `"v5e"`)
    or a torch device name (`"NVIDIA A100-SXM4-40GB"`, matched with `find`). Unknown names raise `ValueError`.

    Example:
        >>> from accelfn.platforms.specs import spec
        >>> spec("H100").key, spec("a100").key, spec("v5p").key, spec("NVIDIA A100-SXM4-40GB").key
        ('h100-sxm', 'a100-80gb', 'tpu-v5p', 'a100-40gb')
        >>> spec("rtx9090")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: unknown device 'rtx9090'; the keys are: gb200, b200, ...
    """
    if not isinstance(name, str):
        raise TypeError(f"specs.spec(): argument 'name' must be a str, got {type(name).__name__}")
    row = _BY_NAME.get(_squash(name)) or find(name)
    if row is None:
        keys = ", ".join(d.key for d in DEVICES)
        raise ValueError(f"unknown device {name!r}; the keys are: {keys} (aliases: {', '.join(_ALIASES)})")
    return row


def _dtype_keys(dtype: torch.dtype) -> tuple[str, ...]:
    if dtype == torch.float32:
        return ("fp32",) if torch.get_float32_matmul_precision() == "highest" else ("tf32",)
    if dtype.is_floating_point and dtype.itemsize == 1:
        return ("fp8",)
    if dtype == torch.bfloat16:
        return ("bf16",)
    if dtype == torch.float16:
        return ("fp16", "bf16")
    return ()


def peak_tflops(spec_or_name: DeviceSpec | str, dtype: torch.dtype) -> float | None:
    """The dense peak TFLOP/s of a device (a row, or a name `spec` takes) for matmuls in `dtype`; None when the
    table has no figure for that dtype.

    float32 reads the tf32 figure when torch lets fp32 matmuls use TF32 (`torch.get_float32_matmul_precision()`
    is not "highest"), else fp32; any 1-byte float reads fp8; float16 reads fp16, else bf16.

    Example:
        >>> import torch
        >>> from accelfn.platforms.specs import peak_tflops
        >>> peak_tflops("h100-pcie", torch.bfloat16), peak_tflops("mi300x", torch.float8_e4m3fnuz)
        (756.0, 2614.9)
        >>> peak_tflops("a100", torch.float8_e4m3fn) is None  # no fp8 on Ampere
        True
    """
    row = spec_or_name if isinstance(spec_or_name, DeviceSpec) else spec(spec_or_name)
    for key in _dtype_keys(dtype):
        if key in row.tflops:
            return row.tflops[key]
    return None
