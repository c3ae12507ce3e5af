"""Mesh: named axes over the processes of a job (a world of one in-process; 4 real processes over gloo)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from _launch import output_of, run_workers

import accelfn as af
from accelfn.mesh import MeshAxisError, parse_axes

LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "ACCELFN_MESH",
    "ACCELFN_DEVICE",
)


@pytest.fixture(autouse=True)
def _not_launched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()
    yield
    af.mesh.destroy_process_group()


def test_unlaunched_from_env_is_a_data_parallel_world_of_one() -> None:
    mesh = af.Mesh.from_env()
    assert dict(mesh.shape) == {"dp": 1} and mesh.axis_names == ("dp",)
    assert (mesh.rank, mesh.world_size, mesh.local_rank, mesh.is_main) == (0, 1, 0, True)
    assert mesh.device == torch.device("cpu") and mesh.device_type == "cpu" and mesh.platform.kind == "cpu"
    assert mesh.torch_mesh.mesh_dim_names == ("dp",) and dist.get_backend() == "gloo"
    assert (mesh.data_axes, mesh.data_size, mesh.data_rank) == (("dp",), 1, 0)


def test_from_env_reads_the_launchers_mesh_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELFN_MESH", "dp=-1,tp=1")
    assert dict(af.Mesh.from_env().shape) == {"dp": 1, "tp": 1}
    assert dict(af.Mesh.from_env(fsdp=1).shape) == {"fsdp": 1}  # explicit axes win


def test_mesh_takes_a_device_kind_or_a_platform() -> None:
    assert af.Mesh({"dp": 1}, device="cpu").platform is af.platforms.get("cpu")
    assert af.Mesh({"dp": 1}, device=af.platforms.get("cpu")).platform.kind == "cpu"
    with pytest.raises(ValueError, match="unknown device kind 'gpu'"):
        af.Mesh({"dp": 1}, device="gpu")


def test_shape_that_does_not_match_the_world_names_both() -> None:
    with pytest.raises(
        ValueError, match=r"mesh shape \{'dp': 2, 'tp': 2\} multiplies to 4 but the world has 1 processes"
    ):
        af.Mesh({"dp": 2, "tp": 2})


def test_only_one_axis_may_be_the_rest() -> None:
    with pytest.raises(ValueError, match="only one axis may be -1 \\(got dp, tp\\)"):
        af.Mesh({"dp": -1, "tp": -1})


def test_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="axis 'tp' has size 0"):
        af.Mesh({"dp": 1, "tp": 0})
    with pytest.raises(ValueError, match="at least one axis"):
        af.Mesh({})


def test_wrong_argument_type_names_the_parameter() -> None:
    with pytest.raises(TypeError, match="argument 'shape'"):
        af.Mesh([("dp", 1)])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="argument 'device'"):
        af.Mesh({"dp": 1}, device=0)  # type: ignore[arg-type]


def test_unknown_axis_lists_the_axes() -> None:
    mesh = af.Mesh({"dp": 1, "tp": 1})
    with pytest.raises(MeshAxisError, match=r"no axis 'fsdp'; its axes are \('dp', 'tp'\)"):
        mesh.axis_size("fsdp")
    with pytest.raises(KeyError):
        mesh.submesh("pp")
    assert mesh.axis_size("tp") == 1 and mesh.axis_rank("dp") == 0 and mesh.submesh("tp").size() == 1


def test_close_and_context_manager_destroy_the_process_group() -> None:
    with af.Mesh({"dp": 1}) as mesh:
        assert dist.is_initialized() and af.Mesh.current() is mesh
    assert not dist.is_initialized() and af.Mesh.current() is None
    with pytest.raises(RuntimeError, match=r"Mesh\(dp=1; cpu, closed\) is closed: .*make a new af.Mesh"):
        _ = mesh.torch_mesh
    with pytest.raises(
        RuntimeError, match=r"Mesh\(dp=1; cpu, closed\) is closed .*read Mesh.rank before closing"
    ):
        _ = mesh.rank  # torch's "Default process group has not been initialized" before
    mesh.close()  # twice is fine


def test_parse_axes() -> None:
    assert parse_axes("dp=2, tp=1") == {"dp": 2, "tp": 1}
    with pytest.raises(ValueError, match="'tp' is not AXIS=SIZE"):
        parse_axes("dp=2,tp")
    with pytest.raises(ValueError, match="names no axes"):
        parse_axes(" , ")


@pytest.mark.slow
def test_four_processes_with_a_2x2_mesh_from_accelfn_mesh() -> None:
    proc = run_workers("mesh_worker.py", 4, env={"ACCELFN_MESH": "dp=-1,tp=2"})
    out = output_of(proc)
    assert proc.returncode == 0, out
    for r in range(4):
        assert f"rank {r}: mesh checks passed" in proc.stdout, out
        assert (
            f"rank {r} shape error: mesh shape {{'dp': 3, 'tp': 3}} multiplies to 9 but the world has 4"
            in proc.stdout
        )
        assert f"rank {r} axis error: this mesh has no axis 'fsdp'; its axes are ('dp', 'tp')" in proc.stdout


def test_a_refused_shape_leaves_no_process_group_running() -> None:
    with pytest.raises(ValueError, match="multiplies to 4 but the world has 1"):
        af.Mesh({"dp": 2, "tp": 2}, device="cpu")
    assert not dist.is_initialized()
