"""accelfn.launch_env.read_env: the launcher -> worker contract, parsed and validated in-process."""

import re

import pytest

from accelfn import launch_env as le
from accelfn.launch_env import read_env

ALL_VARIABLES = (
    *le.ACCELFN_VARIABLES,
    le.RANK,
    le.WORLD_SIZE,
    le.LOCAL_RANK,
    le.LOCAL_WORLD_SIZE,
    le.GROUP_RANK,
    le.MASTER_ADDR,
    le.MASTER_PORT,
    le.RESTART_COUNT,
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Tests run inside whatever environment pytest was started in (maybe under a launcher)."""
    for name in ALL_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_defaults_of_a_plain_single_process():
    e = read_env()
    assert (e.launched, e.device, e.mesh, e.mixed_precision, e.fp8_backend, e.fp8_recipe, e.config_file) == (
        False,
        "auto",
        None,
        "no",
        "auto",
        None,
        None,
    )
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.node_rank, e.restart_count) == (
        0,
        1,
        0,
        1,
        0,
        0,
    )


def test_valid_values_are_parsed_from_os_environ(monkeypatch):
    values = {
        "ACCELFN_LAUNCHED": "1",
        "ACCELFN_DEVICE": "cuda",
        "ACCELFN_MESH": "dp=-1, tp=2",
        "ACCELFN_MIXED_PRECISION": "fp8",
        "ACCELFN_FP8_BACKEND": "torchao",
        "ACCELFN_FP8_RECIPE": "rowwise",
        "ACCELFN_CONFIG_FILE": "/tmp/accelfn.yaml",
        "RANK": "13",
        "WORLD_SIZE": "16",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "3",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    e = read_env()
    assert e == le.LaunchEnv(
        launched=True,
        device="cuda",
        mesh={"dp": -1, "tp": 2},
        mixed_precision="fp8",
        fp8_backend="torchao",
        fp8_recipe="rowwise",
        config_file="/tmp/accelfn.yaml",
        rank=13,
        world_size=16,
        local_rank=1,
        local_world_size=4,
        node_rank=3,
        restart_count=2,
    )
    assert read_env(dict(values)) == e  # an explicit mapping reads the same


@pytest.mark.parametrize(
    "name,allowed",
    [
        (le.ACCELFN_DEVICE, le.DEVICE_KINDS),
        (le.ACCELFN_MIXED_PRECISION, le.MIXED_PRECISION),
        (le.ACCELFN_FP8_BACKEND, le.FP8_BACKENDS),
    ],
)
def test_every_allowed_choice_is_accepted_case_insensitively(monkeypatch, name, allowed):
    field = {
        le.ACCELFN_DEVICE: "device",
        le.ACCELFN_MIXED_PRECISION: "mixed_precision",
        le.ACCELFN_FP8_BACKEND: "fp8_backend",
    }[name]
    for value in allowed:
        monkeypatch.setenv(name, value)
        assert getattr(read_env(), field) == value
        monkeypatch.setenv(name, f" {value.upper()} ")
        assert getattr(read_env(), field) == value


@pytest.mark.parametrize(
    "name,allowed,bad",
    [
        (le.ACCELFN_DEVICE, le.DEVICE_KINDS, "tpu"),
        (le.ACCELFN_MIXED_PRECISION, le.MIXED_PRECISION, "fp32"),
        (le.ACCELFN_FP8_BACKEND, le.FP8_BACKENDS, "transformer_engine"),
    ],
)
def test_a_bad_choice_names_the_variable_and_the_allowed_values(monkeypatch, name, allowed, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError) as info:
        read_env()
    msg = str(info.value)
    assert msg.startswith(f"{name}={bad!r}"), msg
    assert all(re.search(rf"\b{v}\b", msg) for v in allowed), msg
    with pytest.raises(ValueError, match=re.escape(name)):
        read_env({name: bad})  # an explicit mapping is validated too


@pytest.mark.parametrize(
    "name",
    [
        le.RANK,
        le.WORLD_SIZE,
        le.LOCAL_RANK,
        le.LOCAL_WORLD_SIZE,
        le.GROUP_RANK,
        le.RESTART_COUNT,
    ],
)
@pytest.mark.parametrize("bad", ["two", "1.5", "0x10"])
def test_a_bad_integer_names_the_variable(monkeypatch, name, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}={re.escape(repr(bad))} must be an integer"):
        read_env()


@pytest.mark.parametrize(
    "spec,problem",
    [
        ("dp:2", "is not AXIS=SIZE"),
        ("2=dp", "is not AXIS=SIZE"),
        ("dp=two", "must be an integer"),
        ("dp=0", "must be >= 1 or -1"),
        ("dp=-2", "must be >= 1 or -1"),
        ("dp=2,dp=1", "given twice"),
        ("dp=-1,tp=-1", "at most one axis may be -1"),
    ],
)
def test_a_bad_mesh_names_the_variable_and_the_problem(monkeypatch, spec, problem):
    monkeypatch.setenv(le.ACCELFN_MESH, spec)
    with pytest.raises(ValueError, match=rf"^ACCELFN_MESH={re.escape(repr(spec))}: .*{re.escape(problem)}"):
        read_env()


def test_a_bad_mesh_axis_lists_the_usual_axis_names(monkeypatch):
    monkeypatch.setenv(le.ACCELFN_MESH, "dp")
    with pytest.raises(ValueError) as info:
        read_env()
    assert all(axis in str(info.value) for axis in le.MESH_AXES)


def test_empty_values_mean_the_defaults(monkeypatch):
    for name in (le.ACCELFN_DEVICE, le.ACCELFN_MESH, le.ACCELFN_MIXED_PRECISION, le.RANK, le.WORLD_SIZE):
        monkeypatch.setenv(name, "  ")
    e = read_env()
    assert (e.device, e.mesh, e.mixed_precision, e.rank, e.world_size) == ("auto", None, "no", 0, 1)


def test_only_launched_1_means_launched(monkeypatch):
    for value, expected in [("1", True), ("0", False), ("true", False), ("", False)]:
        monkeypatch.setenv(le.ACCELFN_LAUNCHED, value)
        assert read_env().launched is expected


def test_parse_mesh_and_format_mesh_round_trip():
    axes = le.parse_mesh("dp_shard=2, tp=4,,pp=-1")
    assert axes == {"dp_shard": 2, "tp": 4, "pp": -1}
    assert le.format_mesh(axes) == "dp_shard=2,tp=4,pp=-1"
    assert le.parse_mesh(le.format_mesh(axes)) == axes
    with pytest.raises(ValueError, match=r"^--mesh='dp=0'"):
        le.parse_mesh("dp=0", source="--mesh")


def test_the_launcher_checks_the_mesh_against_the_process_count_and_the_script_path(tmp_path, capsys):
    # refused before any worker starts (exit 2, one line), not by every worker with a traceback
    from accelfn.cli.launch import launch
    from accelfn.launch.config import ConfigError
    from accelfn.launch.launcher import LaunchOptions, resolve

    with pytest.raises(
        ConfigError, match=r"--mesh dp=3: the axis sizes multiply to 3, but the job has 2 processes"
    ):
        resolve(LaunchOptions(script="t.py", nproc_per_node=2, cpu=True, mesh="dp=3"), environ={})
    with pytest.raises(ConfigError, match=r"multiply to 3 times the -1 axis, but the job has 4 processes"):
        resolve(LaunchOptions(script="t.py", nproc_per_node=4, cpu=True, mesh="dp=-1,tp=3"), environ={})
    assert resolve(LaunchOptions(script="t.py", nproc_per_node=4, cpu=True, mesh="dp=-1,tp=2"), environ={})
    plan = tmp_path / "plan.yaml"  # a written plan's mesh for another world: the error names the config key
    plan.write_text("mesh: dp=8\n")
    with pytest.raises(
        ConfigError, match=rf"config key 'mesh' in {plan} dp=8: the axis sizes multiply to 8, but"
    ):
        resolve(LaunchOptions(script="t.py", nproc_per_node=2, cpu=True, config_file=str(plan)), environ={})
    missing = tmp_path / "trian.py"
    assert launch(LaunchOptions(script=str(missing), nproc_per_node=1, cpu=True)) == 2
    assert f"{missing}: no such file" in capsys.readouterr().err
