"""Device-kind adapters. Only cpu runs for real here; the other kinds are checked against fake modules."""

from __future__ import annotations

import subprocess
import sys
import types
from typing import Any

import pytest
import torch

import accelfn as af
from accelfn.platforms import Platform


@pytest.fixture(autouse=True)
def _no_forced_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ACCELFN_DEVICE", raising=False)


def fake_accelerator(count: int = 2, **extra: Any) -> types.SimpleNamespace:
    """A stand-in for `torch.cuda`-like modules (torch.npu, torch.mlu), recording calls."""
    calls: list[tuple[str, Any]] = []
    rng = {"state": torch.tensor([1, 2, 3], dtype=torch.uint8)}
    ns = types.SimpleNamespace(
        calls=calls,
        is_available=lambda: True,
        device_count=lambda: count,
        current_device=lambda: 0,
        set_device=lambda d: calls.append(("set_device", d)),
        synchronize=lambda d=None: calls.append(("synchronize", d)),
        memory_allocated=lambda d=None: 100,
        max_memory_allocated=lambda d=None: 300,
        memory_reserved=lambda d=None: 200,
        get_device_properties=lambda d: types.SimpleNamespace(total_memory=1000),
        get_rng_state=lambda d: rng["state"].clone(),
        set_rng_state=lambda s, d: rng.update(state=s.clone()),
        manual_seed_all=lambda seed: calls.append(("manual_seed_all", seed)),
    )
    for k, v in extra.items():
        setattr(ns, k, v)
    return ns


def install_fake_extension(monkeypatch: pytest.MonkeyPatch, package: str, attr: str, **kw: Any) -> Any:
    """Put a fake extension package in sys.modules and its `torch.<attr>` namespace on torch."""
    monkeypatch.setitem(sys.modules, package, types.ModuleType(package))
    fake = fake_accelerator(**kw)
    monkeypatch.setattr(torch, attr, fake, raising=False)
    return fake


def install_fake_torch_xla(monkeypatch: pytest.MonkeyPatch, device_type: str | None = "TPU") -> Any:
    calls: list[str] = []
    mods = {name: types.ModuleType(name) for name in (
        "torch_xla", "torch_xla.runtime", "torch_xla.core", "torch_xla.core.xla_model",
        "torch_xla.distributed", "torch_xla.distributed.xla_backend")}  # fmt: skip
    xr, xm = mods["torch_xla.runtime"], mods["torch_xla.core.xla_model"]
    xr.device_type = lambda: device_type  # type: ignore[attr-defined]
    xr.addressable_runtime_device_count = lambda: 4  # type: ignore[attr-defined]
    xm.get_memory_info = lambda d: {"bytes_used": 5, "bytes_limit": 50, "peak_bytes_used": 7}  # type: ignore[attr-defined]
    xm.get_rng_state = lambda d=None: 1234  # type: ignore[attr-defined]
    xm.set_rng_state = lambda seed, d=None: calls.append(f"set_rng_state {seed}")  # type: ignore[attr-defined]
    xm.mark_step = lambda: calls.append("mark_step")  # type: ignore[attr-defined]
    xm.wait_device_ops = lambda: calls.append("wait_device_ops")  # type: ignore[attr-defined]
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


# ---- the registry ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "backend", "env", "device_type"),
    [
        ("cpu", "gloo", None, "cpu"),
        ("cuda", "nccl", "CUDA_VISIBLE_DEVICES", "cuda"),
        ("xla", "xla", "TPU_VISIBLE_CHIPS", "xla"),
        ("xpu", "xccl", "ZE_AFFINITY_MASK", "xpu"),
        ("npu", "hccl", "ASCEND_RT_VISIBLE_DEVICES", "npu"),
        ("mlu", "cncl", "MLU_VISIBLE_DEVICES", "mlu"),
    ],
)
def test_each_kind_knows_its_backend_env_var_and_autocast_type(
    kind: str, backend: str, env: str | None, device_type: str
) -> None:
    p = af.platforms.get(kind)
    assert isinstance(p, Platform)
    assert (p.kind, p.backend, p.visible_devices_env, p.device_type) == (kind, backend, env, device_type)
    assert p.autocast_device_type == device_type


def test_unknown_kind_lists_the_kinds() -> None:
    with pytest.raises(
        ValueError, match="unknown device kind 'gpu'; the kinds are: cpu, cuda, xla, xpu, npu, mlu"
    ):
        af.platforms.get("gpu")


def test_get_checks_its_argument_type() -> None:
    with pytest.raises(TypeError, match="'kind' must be a str"):
        af.platforms.get(0)  # type: ignore[arg-type]


def test_from_backend_maps_backends_to_kinds() -> None:
    assert af.platforms.from_backend("gloo").kind == "cpu"
    assert af.platforms.from_backend("nccl").kind == "cuda"
    with pytest.raises(ValueError, match="'mpi'.*gloo \\(cpu\\)"):
        af.platforms.from_backend("mpi")


# ---- cpu, for real -------------------------------------------------------------------------------------------
def test_cpu_is_always_available_and_detected_on_this_machine() -> None:
    cpu = af.platforms.get("cpu")
    assert cpu.is_available() and cpu.device_count() == 1
    assert cpu.device(3) == torch.device("cpu")
    assert af.platforms.detect() is cpu
    assert af.platforms.available()[-1] is cpu


def test_cpu_rng_state_round_trips() -> None:
    cpu = af.platforms.get("cpu")
    state = cpu.get_rng_state()
    a = torch.rand(3)
    cpu.set_rng_state(state)
    assert torch.equal(torch.rand(3), a)
    cpu.manual_seed(5)
    b = torch.rand(2)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(2), b)


def test_cpu_capabilities_and_memory() -> None:
    cpu = af.platforms.get("cpu")
    assert cpu.supports_bf16() and not cpu.supports_fp8() and cpu.has_fused_optimizer()
    stats = cpu.memory_stats()
    assert stats["peak_allocated"] > 0 and stats["total"] >= stats["allocated"] > 0
    cpu.synchronize()


# ---- ACCELFN_DEVICE --------------------------------------------------------------------------------------
def test_accelfn_device_forces_a_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert af.platforms.detect().kind == "cuda"
    monkeypatch.setenv("ACCELFN_DEVICE", "cpu")  # what `accelfn launch --cpu` sets
    assert af.platforms.detect().kind == "cpu"
    monkeypatch.setenv("ACCELFN_DEVICE", "auto")
    assert af.platforms.detect().kind == "cuda"


def test_accelfn_device_naming_an_unavailable_kind_says_what_is_available(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ACCELFN_DEVICE", "xpu")
    with pytest.raises(
        RuntimeError, match="ACCELFN_DEVICE='xpu' but no xpu device is available.*available: cpu"
    ):
        af.platforms.detect()
    monkeypatch.setenv("ACCELFN_DEVICE", "tpu")
    with pytest.raises(ValueError, match="ACCELFN_DEVICE='tpu': unknown device kind"):
        af.platforms.detect()


# ---- cuda and xpu, with faked torch attributes --------------------------------------------------------------
def test_fake_cuda_is_detected_and_maps_local_ranks_to_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    p = af.platforms.detect()
    assert p.kind == "cuda" and p.device_count() == 2
    assert [str(p.device(r)) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert p.process_group_kwargs() == {"backend": "nccl", "init_method": "env://"}


def test_cuda_fp8_needs_compute_capability_8_9(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    cuda = af.platforms.get("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert not cuda.supports_fp8()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert cuda.supports_fp8()


def test_no_visible_device_error_names_the_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        RuntimeError, match="no cuda device is visible.*CUDA_VISIBLE_DEVICES.*ACCELFN_DEVICE=cpu"
    ):
        af.platforms.get("cuda").device(0)


def test_fake_xpu_is_detected_after_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 4)
    p = af.platforms.detect()
    assert p.kind == "xpu" and str(p.device(2)) == "xpu:2" and p.has_fused_optimizer()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert af.platforms.detect().kind == "cuda"


# ---- npu and mlu, with fake extension packages --------------------------------------------------------------
@pytest.mark.parametrize(("kind", "package"), [("npu", "torch_npu"), ("mlu", "torch_mlu")])
def test_extension_kinds_are_unavailable_without_their_package(kind: str, package: str) -> None:
    p = af.platforms.get(kind)
    assert p.package == package
    assert not p.is_available() and p.device_count() == 0
    assert package not in sys.modules
    with pytest.raises(RuntimeError, match=f"install {package}"):
        p.memory_stats()


@pytest.mark.parametrize(("kind", "package"), [("npu", "torch_npu"), ("mlu", "torch_mlu")])
def test_fake_extension_kind_is_detected_and_serves_state(
    monkeypatch: pytest.MonkeyPatch, kind: str, package: str
) -> None:
    fake = install_fake_extension(monkeypatch, package, kind)
    p = af.platforms.detect()
    assert p.kind == kind and p.device_count() == 2
    assert p.memory_stats() == {"allocated": 100, "peak_allocated": 300, "reserved": 200, "total": 1000}
    state = p.get_rng_state()
    p.set_rng_state(state + 1)
    assert torch.equal(p.get_rng_state(), state + 1)
    p.manual_seed(3)
    p.synchronize()
    assert fake.calls == [("manual_seed_all", 3), ("synchronize", None)]
    assert p.supports_bf16() and not p.supports_fp8()


def test_detection_order_prefers_npu_over_mlu(monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_extension(monkeypatch, "torch_npu", "npu")
    install_fake_extension(monkeypatch, "torch_mlu", "mlu")
    assert [p.kind for p in af.platforms.available()] == ["npu", "mlu", "cpu"]


@pytest.mark.parametrize("kind", ["npu", "mlu"])
def test_extension_device_strings_once_the_extension_registers_its_name(kind: str) -> None:
    # A real torch_npu / torch_mlu renames torch's privateuse1 device; that is global, so check in a fresh process.
    code = f"""
import sys, types, torch
torch.utils.rename_privateuse1_backend({kind!r})
sys.modules["torch_{kind}"] = types.ModuleType("torch_{kind}")
torch.{kind} = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2)
import accelfn as af
p = af.platforms.get({kind!r})
print(p.device(0), p.device(1), p.device(2))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"{kind}:0", f"{kind}:1", f"{kind}:0"]


# ---- xla, with a fake torch_xla -----------------------------------------------------------------------------
def test_fake_torch_xla_is_detected_first(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = install_fake_torch_xla(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    p = af.platforms.detect()
    assert p.kind == "xla" and p.device_count() == 4 and str(p.device(1)) == "xla:1"
    assert p.process_group_kwargs() == {"backend": "xla", "init_method": "xla://"}
    assert p.memory_stats() == {"allocated": 5, "total": 50, "peak_allocated": 7}
    assert int(p.get_rng_state()) == 1234
    p.set_rng_state(torch.tensor(9))
    p.synchronize()
    assert calls == ["set_rng_state 9", "mark_step", "wait_device_ops"]
    assert not p.has_fused_optimizer() and not p.supports_fp8()


def test_torch_xla_without_a_pjrt_device_is_not_available(monkeypatch: pytest.MonkeyPatch) -> None:
    install_fake_torch_xla(monkeypatch, device_type=None)
    assert not af.platforms.get("xla").is_available()
    assert af.platforms.detect().kind == "cpu"


def test_mesh_and_dist_code_names_no_device_kind() -> None:
    import ast
    import pathlib

    root = pathlib.Path(af.__file__).parent
    kinds = set(af.platforms.KINDS) | {"gloo", "nccl", "xccl", "hccl", "cncl"}
    for path in [root / "mesh.py", *sorted((root / "collective").glob("*.py"))]:
        module = ast.parse(path.read_text())
        docstrings = {
            id(n.value)
            for n in ast.walk(module)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
        }
        for node in ast.walk(module):
            if isinstance(node, ast.Constant) and id(node) not in docstrings:
                assert node.value not in kinds, f"{path.name}:{node.lineno} branches on {node.value!r}"
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "torch"
            ):
                assert node.attr not in kinds, f"{path.name}:{node.lineno} uses torch.{node.attr}"


def test_tune_host_allocator_sets_glibc_thresholds_once_and_can_be_turned_off():
    import os
    import subprocess
    import sys

    code = ("import accelfn as af, torch; from accelfn.platforms import cpu; "
            "af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)).init(torch.nn.Linear(2, 2)); "
            "print(cpu._TUNED)")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "ACCELFN_HOST_ALLOCATOR"}
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, "ACCELFN_HOST_ALLOCATOR": "system"})  # fmt: skip
    assert on.stdout.strip() == "[True]", (
        on.stderr
    )  # glibc (the CI machines): set by the first CPU train step
    assert off.stdout.strip() == "[False]", off.stderr


# ---- questions callers ask instead of naming device types ---------------------------------------------------
def test_is_host_and_count_dtype() -> None:
    assert af.platforms.is_host(torch.device("cpu")) and af.platforms.is_host("cpu")
    assert not af.platforms.is_host("cuda:1") and not af.platforms.is_host(torch.device("meta"))
    assert af.platforms.count_dtype("cpu") == torch.float64  # exact bias corrections on the host
    assert (
        af.platforms.count_dtype(torch.device("cuda", 0)) == af.platforms.count_dtype("mps") == torch.float32
    )


def test_supports_float64_asks_the_platform_and_knows_kinds_without_one() -> None:
    assert af.platforms.get("cpu").supports_float64() and af.platforms.supports_float64("cuda:0")
    assert not af.platforms.supports_float64("mps")  # no adapter: Metal has no float64
    assert af.platforms.supports_float64("meta")

    class NoF64(Platform):  # a registered kind answers for its device type
        kind, device_type, backend = "nof64", "meta", "gloo"

        def supports_float64(self) -> bool:
            return False

    af.platforms.register(NoF64())
    try:
        assert not af.platforms.supports_float64(torch.device("meta"))
    finally:
        af.platforms.unregister("nof64")
    assert af.platforms.supports_float64("meta")


def test_pins_host_copies_only_for_an_available_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not af.platforms.pins_host_copies("cpu") and not af.platforms.pins_host_copies("meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not af.platforms.pins_host_copies("cuda:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert af.platforms.pins_host_copies("cuda:0")
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 1)
    assert not af.platforms.pins_host_copies("xpu:0")  # as before: staging buffers are pinned for CUDA only


def test_tune_allocator_is_the_host_allocators_on_cpu_and_nothing_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from accelfn.platforms import cpu

    calls: list[int] = []
    monkeypatch.setattr(cpu, "tune_host_allocator", lambda: calls.append(1) or True)
    assert af.platforms.get("cpu").tune_allocator() is True and af.platforms.tune_allocator("cpu") is True
    assert len(calls) == 2
    for kind in ("cuda", "xla", "xpu", "npu", "mlu"):
        assert af.platforms.get(kind).tune_allocator() is False
    assert af.platforms.tune_allocator("cuda:0") is False and af.platforms.tune_allocator("meta") is False
    assert calls == [1, 1]


def test_tune_allocator_for_real_reports_what_tune_host_allocator_did() -> None:
    from accelfn.platforms import cpu

    assert af.platforms.get("cpu").tune_allocator() == cpu.tune_host_allocator() == cpu._TUNED[0]


def test_initialized_asks_every_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not af.platforms.get("cpu").is_initialized()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.xpu, "is_initialized", lambda: False, raising=False)
    assert af.platforms.initialized() == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert af.platforms.initialized() == [af.platforms.get("cuda")]


def test_an_extension_kind_is_initialized_only_once_its_package_is_imported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    npu = af.platforms.get("npu")
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(is_initialized=lambda: True), raising=False)
    assert not npu.is_initialized()  # and torch_npu was not imported to ask
    assert "torch_npu" not in sys.modules
    install_fake_extension(monkeypatch, "torch_npu", "npu", is_initialized=lambda: True)
    assert npu.is_initialized()
    install_fake_extension(monkeypatch, "torch_npu", "npu")  # a module without is_initialized
    assert not npu.is_initialized()


def test_notebook_fork_refuses_once_an_accelerator_runtime_started(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelfn.launch.notebook import _start_method

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.xpu, "is_initialized", lambda: False, raising=False)
    assert _start_method(print, "fork") == "fork"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(RuntimeError, match="CUDA was initialized .* start_method='spawn'"):
        _start_method(print, "fork")


def test_async_checkpoint_staging_waits_for_the_copies_through_their_platform(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from accelfn.checkpoint import async_

    synced: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: synced.append(d))
    monkeypatch.setattr(async_, "_copying_from", {torch.device("cuda", 1)})
    async_.start(lambda: None, "ckpt").result()
    assert synced == [torch.device("cuda", 1)] and not async_._copying_from
    async_.stage("test_platforms.w", torch.ones(2))  # a host tensor: an unpinned, synchronous copy
    async_.start(lambda: None, "ckpt").result()
    assert synced == [torch.device("cuda", 1)]
    del async_._staging["test_platforms.w"]
