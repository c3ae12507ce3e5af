"""The device table (`accelfn.platforms.specs`): its rows, name lookup, dtype mapping, and that the platforms and
`af.Meter` read it (cuda, ROCm and xla against fake modules, as in test_platforms.py)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import accelfn as af
from accelfn.dryrun import Assumptions
from accelfn.meter import Meter
from accelfn.platforms import specs
from accelfn.platforms.cuda import peak_tflops_of

# what torch (`torch.cuda.get_device_name()`, torch_xla's device kind, `torch.hpu`) calls each row's device
DEVICE_NAMES = {
    "gb200": "NVIDIA GB200",
    "b200": "NVIDIA B200",
    "h200-nvl": "NVIDIA H200 NVL",
    "h200-sxm": "NVIDIA H200",
    "h100-nvl": "NVIDIA H100 NVL",
    "h100-pcie": "NVIDIA H100 PCIe",
    "h100-96gb": "NVIDIA H100",  # Meta's HBM2e part reports no form factor or memory (pytorch/torchtitan#554)
    "h100-sxm": "NVIDIA H100 80GB HBM3",
    "a100-40gb": "NVIDIA A100-SXM4-40GB",
    "a100-80gb": "NVIDIA A100-SXM4-80GB",
    "l40s": "NVIDIA L40S",
    "l4": "NVIDIA L4",
    "a10g": "NVIDIA A10G",
    "mi355x": "AMD Instinct MI355X",
    "mi325x": "AMD Instinct MI325X",
    "mi300x": "AMD Instinct MI300X",
    "gaudi3": "GAUDI3",
    "tpu-v5p": "TPU v5",
    "tpu-v5e": "TPU v5 lite",
}


@pytest.fixture(autouse=True)
def _no_forced_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELFN_DEVICE", raising=False)


@pytest.fixture
def matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


# ---- the rows ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("row", specs.DEVICES, ids=[d.key for d in specs.DEVICES])
def test_every_row_is_complete(row: specs.DeviceSpec) -> None:
    assert row.tflops["bf16"] > 0 and all(v > 0 for v in row.tflops.values())
    assert set(row.tflops) <= set(specs.TFLOPS_KEYS)
    assert row.memory_gib > 0 and row.memory_bytes == int(row.memory_gib * 2**30)
    assert row.memory_gbs > 0 and row.intra_node_gbs > 0 and row.inter_node_gbs > 0
    assert row.devices_per_node >= 1
    assert row.kind in (*af.platforms.KINDS, "hpu")
    assert row.key == row.key.lower() and specs.spec(row.key) is row
    if row.key == "cpu":  # nominal figures: no data sheet, and no device name matches it
        assert row.pattern == "" and row.source == ""
    else:
        assert row.source.startswith("https://"), row.key
        assert row.pattern and specs.find(DEVICE_NAMES[row.key]) is row


def test_keys_are_unique_and_every_row_has_a_device_name_here() -> None:
    keys = [d.key for d in specs.DEVICES]
    assert len(set(keys)) == len(keys)
    assert set(DEVICE_NAMES) == set(keys) - {"cpu"}


def test_rows_are_frozen() -> None:
    row = specs.spec("h100")
    with pytest.raises(AttributeError):
        row.memory_gib = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        row.tflops["bf16"] = 1.0  # type: ignore[index]
    with pytest.raises(ValueError, match="unknown keys"):
        specs.DeviceSpec("x", "X", "cuda", "", {"int8": 1.0}, 1.0, 1.0, 1.0, 1.0, 1, "")


def test_the_table_agrees_with_the_meters_figures_of_before() -> None:
    # the figures `peak_tflops_of` had before the table moved here
    assert specs.spec("h100-sxm").tflops == {
        "fp32": 67.0,
        "tf32": 494.7,
        "bf16": 989.0,
        "fp16": 989.0,
        "fp8": 1979.0,
    }
    assert specs.spec("h100-pcie").tflops["bf16"] == 756.0 and specs.spec("h100-nvl").tflops["bf16"] == 835.0
    assert specs.spec("a100-80gb").tflops == specs.spec("a100-40gb").tflops
    assert specs.spec("l40s").tflops["fp8"] == 733.0 and specs.spec("a10g").tflops["tf32"] == 62.5


def test_new_rows_follow_from_their_vendors_chip_figures() -> None:
    # MI355X: 256 CUs at 2.4 GHz (AMD's CDNA 4 figures); per CU and clock 4096 fp16/bf16 and 8192 fp8 matrix
    # FLOPs, 256 fp32: the rounded data-sheet figures follow
    mi355x = specs.spec("mi355x")
    for key, per_clock in (("bf16", 4096), ("fp16", 4096), ("fp8", 8192), ("fp32", 256)):
        assert mi355x.tflops[key] == pytest.approx(256 * 2.4e9 * per_clock / 1e12, abs=0.05), key
    assert "tf32" not in mi355x.tflops and mi355x.power_w == 1400.0 and mi355x.memory_gib == 288.0
    # GB200, per GPU: NVIDIA prints per superchip (two GPUs) with 2:4 sparsity: 10 PF bf16, 20 PF fp8, 5 PF tf32
    gb200 = specs.spec("gb200")
    assert {k: gb200.tflops[k] for k in ("bf16", "fp8", "tf32")} == {
        "bf16": 2500.0,
        "fp8": 5000.0,
        "tf32": 1250.0,
    }
    assert gb200.memory_gib * 72 == pytest.approx(13.4e3, rel=0.01)  # the NVL72 rack's "13.4 TB"
    assert (
        gb200.tflops["bf16"] > specs.spec("b200").tflops["bf16"]
        and gb200.power_w > specs.spec("b200").power_w
    )
    # the 96 GB HBM2e H100 (torchtitan's benchmarks) at 500 W: the same die's data sheet ratings at 700 W (SXM) and
    # 400 W (NVL), interpolated in the power limit; its own memory
    h96, sxm, nvl = specs.spec("h100-96gb"), specs.spec("h100-sxm"), specs.spec("h100-nvl")
    for dtype in ("fp32", "tf32", "bf16", "fp16", "fp8"):
        at_500 = nvl.tflops[dtype] + (sxm.tflops[dtype] - nvl.tflops[dtype]) * (500 - 400) / (700 - 400)
        assert h96.tflops[dtype] == pytest.approx(at_500, abs=0.05), dtype
    assert h96.intra_node_gbs == sxm.intra_node_gbs
    assert (h96.memory_gib, h96.memory_gbs, h96.power_w, sxm.power_w) == (96.0, 2400.0, 500.0, 700.0)


def test_power_is_given_only_where_it_sets_the_clocks() -> None:
    assert {d.key for d in specs.DEVICES if d.power_w is not None} == {
        "gb200",
        "b200",
        "h100-96gb",
        "h100-sxm",
        "mi355x",
    }


@pytest.mark.parametrize(("key", "fits"), [("h100-96gb", True), ("h100-sxm", False), ("gb200", True)])
def test_dry_run_measures_against_the_new_rows(key: str, fits: bool) -> None:
    """What the issue hit: a run of ~86 GiB per GPU fits the 96 GB H100 torchtitan ran on, not the 80 GB row."""

    def main() -> None:
        step = af.train_step(lambda m, b: m(b).float().sum(), af.optim.sgd(0.1))
        with af.init_empty():
            model = torch.nn.Linear(2**17, 2**16, bias=False, dtype=torch.bfloat16)  # 16 GiB of bf16
        model.register_buffer("extra", torch.empty(54 * 2**30, dtype=torch.uint8, device="meta"))
        state = step.init(model)
        step(state, torch.zeros(4, 2**17, dtype=torch.bfloat16))

    report = af.dry_run(main, nproc_per_node=1, device="cuda", gpu=key, search=False)
    assert report.gpu == key and report.capacity_bytes is not None
    assert report.capacity_bytes == specs.spec(key).memory_bytes - Assumptions().reserve_bytes
    assert 80 * 2**30 < report.per_rank["peak"] < 92 * 2**30
    assert report.fits is fits


# ---- names -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("h100", "h100-sxm"),
        ("H100", "h100-sxm"),
        ("H100 SXM", "h100-sxm"),
        ("h100_pcie", "h100-pcie"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("nvidia h100 pcie", "h100-pcie"),
        ("h200", "h200-sxm"),
        ("H200 NVL", "h200-nvl"),
        ("a100", "a100-80gb"),
        ("A100-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb"),
        ("mi300x", "mi300x"),
        ("AMD MI300X", "mi300x"),
        ("AMD Instinct MI325X", "mi325x"),
        ("MI355X", "mi355x"),
        ("GB200", "gb200"),
        ("NVIDIA GB200", "gb200"),
        ("h100-96gb", "h100-96gb"),
        ("H100 96GB HBM2e", "h100-96gb"),
        ("h100 hbm2e", "h100-96gb"),
        ("NVIDIA H100", "h100-sxm"),  # the alias "h100" before the device name (which `find` matches)
        ("Gaudi 3", "gaudi3"),
        ("tpu-v5p", "tpu-v5p"),
        ("v5p", "tpu-v5p"),
        ("TPU v5p", "tpu-v5p"),
        ("v5e", "tpu-v5e"),
        ("v5litepod", "tpu-v5e"),
        (" CPU ", "cpu"),
    ],
)
def test_spec_takes_keys_aliases_and_device_names(name: str, key: str) -> None:
    assert specs.spec(name).key == key


def test_spec_rejects_unknown_names_listing_the_keys() -> None:
    with pytest.raises(
        ValueError, match=r"unknown device 'rtx9090'; the keys are: .*h100-sxm.*mi300x.*tpu-v5p"
    ):
        specs.spec("rtx9090")
    with pytest.raises(ValueError, match="unknown device ''"):
        specs.spec("")
    with pytest.raises(TypeError, match="must be a str"):
        specs.spec(100)  # type: ignore[arg-type]


def test_find_prefers_the_specific_row() -> None:
    assert specs.find("NVIDIA H100 PCIe").key == "h100-pcie"
    assert specs.find("NVIDIA H100 NVL").key == "h100-nvl"
    assert specs.find("NVIDIA H100 80GB HBM3").key == "h100-sxm"
    assert specs.find("NVIDIA H100").key == "h100-96gb"  # only the bare name: not "NVIDIA H100 80GB HBM3"
    assert specs.find("NVIDIA GB200").key == "gb200" and specs.find("NVIDIA B200").key == "b200"
    assert specs.find("AMD Instinct MI355X").key == "mi355x"
    assert specs.find("NVIDIA H200 NVL").key == "h200-nvl"
    assert specs.find("NVIDIA H200").key == "h200-sxm"
    assert specs.find("NVIDIA L40S").key == "l40s" and specs.find("NVIDIA L4").key == "l4"
    assert specs.find("NVIDIA A100-PCIE-40GB").key == "a100-40gb"
    assert specs.find("TPU v5 lite").key == "tpu-v5e" and specs.find("TPU v5").key == "tpu-v5p"


def test_find_matches_device_names_only() -> None:
    for name in ("h100", "a100", "v5p", "cpu", "", "NVIDIA GH200 480GB", "NVIDIA GB300", "NVIDIA A10"):
        assert specs.find(name) is None, name


# ---- dtypes ------------------------------------------------------------------------------------------------
def test_peak_tflops_maps_dtypes_to_table_keys() -> None:
    h100 = specs.spec("h100")
    assert specs.peak_tflops(h100, torch.bfloat16) == 989.0
    assert specs.peak_tflops("h100", torch.float16) == 989.0
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz):
        assert specs.peak_tflops(h100, fp8) == 1979.0
    assert specs.peak_tflops("a100", torch.float8_e4m3fn) is None  # no fp8 on Ampere
    assert specs.peak_tflops("gaudi3", torch.float16) == 1835.0  # fp16 falls back to bf16
    assert specs.peak_tflops("h100", torch.int8) is None and specs.peak_tflops("h100", torch.float64) is None
    with pytest.raises(ValueError, match="unknown device"):
        specs.peak_tflops("rtx9090", torch.bfloat16)


def test_peak_tflops_for_float32_follows_torchs_matmul_precision(matmul_precision) -> None:
    matmul_precision("highest")
    assert specs.peak_tflops("a100", torch.float32) == 19.5
    assert specs.peak_tflops("tpu-v5e", torch.float32) is None
    matmul_precision("high")
    assert specs.peak_tflops("a100", torch.float32) == 156.0
    matmul_precision("medium")
    assert specs.peak_tflops("mi300x", torch.float32) == 653.7
    assert specs.peak_tflops("cpu", torch.float32) is None  # no tf32 figure for the nominal cpu


def test_cuda_peak_tflops_of_reads_the_table_for_gpus_only() -> None:
    assert peak_tflops_of("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.0
    assert peak_tflops_of("AMD Instinct MI300X", torch.bfloat16) == 1307.4
    assert peak_tflops_of("TPU v5", torch.bfloat16) is None  # an xla row
    assert peak_tflops_of("GAUDI3", torch.bfloat16) is None  # an hpu row


# ---- platforms and the meter read it -----------------------------------------------------------------------
def fake_cuda(monkeypatch: pytest.MonkeyPatch, name: str, *, rocm: bool = False) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: name)
    monkeypatch.setattr(torch.version, "cuda", None if rocm else "12.8")
    monkeypatch.setattr(torch.version, "hip", "6.4" if rocm else None, raising=False)


@pytest.mark.parametrize(
    "key",
    [
        "h100-sxm",
        "h100-96gb",
        "h100-pcie",
        "h200-nvl",
        "b200",
        "gb200",
        "a100-40gb",
        "l4",
        "mi300x",
        "mi355x",
    ],
)
def test_cuda_platform_reads_the_table(monkeypatch: pytest.MonkeyPatch, key: str) -> None:
    fake_cuda(monkeypatch, DEVICE_NAMES[key], rocm=key.startswith("mi"))
    cuda = af.platforms.get("cuda")
    for dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32):
        assert cuda.peak_tflops(dtype) == specs.peak_tflops(key, dtype)


def test_cuda_platform_knows_no_peak_without_a_gpu_or_for_an_unknown_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert af.platforms.get("cuda").peak_tflops(torch.bfloat16) is None
    fake_cuda(monkeypatch, "NVIDIA GeForce GT 710")
    assert af.platforms.get("cuda").peak_tflops(torch.bfloat16) is None
    assert af.platforms.get("cpu").peak_tflops(torch.bfloat16) is None  # the nominal cpu row is not read


def test_meter_mfu_divides_by_the_tables_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    step = af.train_step(lambda m, b: m(b).float().mean(), af.optim.sgd(0.1))
    step.init(torch.nn.Linear(4, 4).to(torch.bfloat16))
    meter = Meter(step)
    fake_cuda(monkeypatch, "AMD Instinct MI300X", rocm=True)
    assert meter.peak() is None  # on the cpu platform
    monkeypatch.setattr(Meter, "_platform", property(lambda self: af.platforms.get("cuda")))
    assert meter.peak() == specs.spec("mi300x").tflops["bf16"] == 1307.4
    assert Meter(step, peak_tflops=2.0).peak() == 2.0  # the override still wins


def install_fake_torch_xla(monkeypatch: pytest.MonkeyPatch, device_kind: str | None) -> None:
    names = ("torch_xla", "torch_xla.runtime", "torch_xla.core", "torch_xla.core.xla_model")
    mods = {name: types.ModuleType(name) for name in names}
    mods["torch_xla.runtime"].device_type = lambda: "TPU"  # type: ignore[attr-defined]
    if device_kind is not None:  # older torch_xla has no xla_device_kind
        mods["torch_xla.core.xla_model"].xla_device_kind = lambda d=None: device_kind  # type: ignore[attr-defined]
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


@pytest.mark.parametrize(
    ("device_kind", "bf16"), [("TPU v5 lite", 197.0), ("TPU v5", 459.0), ("TPU v9", None), (None, None)]
)
def test_xla_platform_reads_the_table_by_device_kind(
    monkeypatch: pytest.MonkeyPatch, device_kind: str | None, bf16: float | None
) -> None:
    install_fake_torch_xla(monkeypatch, device_kind)
    assert af.platforms.get("xla").peak_tflops(torch.bfloat16) == bf16


def test_other_accelerator_kinds_read_only_rows_of_their_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 1)
    monkeypatch.setattr(torch.xpu, "get_device_name", lambda d=None: "Intel(R) Data Center GPU Max 1550")
    xpu = af.platforms.get("xpu")
    assert xpu.peak_tflops(torch.bfloat16) is None
    monkeypatch.setattr(torch.xpu, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    assert xpu.peak_tflops(torch.bfloat16) is None  # a cuda row: not for xpu


def test_the_docs_table_shows_every_row_as_the_code_has_it() -> None:
    from pathlib import Path

    docs = (Path(__file__).parents[1] / "docs" / "devices.md").read_text()
    rows = {
        cells[0].strip("`"): cells
        for line in docs.splitlines()
        if line.startswith("| `") and (cells := [c.strip() for c in line.strip("|").split("|")])
    }
    assert set(rows) == {d.key for d in specs.DEVICES}

    def num(cell: str) -> float | None:
        return None if cell == "–" else float(cell)

    for d in specs.DEVICES:
        cells = rows[d.key]
        assert cells[1] == d.name
        assert [num(c) for c in cells[2:7]] == [
            d.tflops.get(k) for k in ("bf16", "fp16", "fp8", "tf32", "fp32")
        ]
        figures = (
            d.memory_gib,
            d.memory_gbs,
            d.intra_node_gbs,
            d.inter_node_gbs,
            d.devices_per_node,
            d.power_w,
        )
        assert tuple(num(c) for c in cells[7:13]) == figures, d.key
