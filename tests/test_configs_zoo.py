"""The config zoo (examples/configs/*.yaml): every file loads with the launcher's own loader and validation,
resolves to a launch plan, and the CPU one runs 2 processes through `accelfn launch --config-file`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import yaml

from accelfn.launch.config import Config, load
from accelfn.launch.launcher import LaunchOptions, resolve

ROOT = Path(__file__).parent.parent
CONFIGS = ROOT / "examples" / "configs"
ZOO = sorted(CONFIGS.glob("*.yaml"))


def test_the_zoo_has_each_setup():
    names = {p.stem for p in ZOO}
    assert {"one_gpu", "multi_gpu", "multi_node", "fsdp", "deepspeed", "fp8", "cpu"} <= names


@pytest.mark.parametrize("path", ZOO, ids=[p.stem for p in ZOO])
def test_every_config_is_valid_and_uses_only_known_keys(path):
    cfg = load(path)  # unknown keys and bad values raise ConfigError
    raw = yaml.safe_load(path.read_text())
    known = {f.name for f in attrs.fields(Config)}
    assert set(raw) <= known, set(raw) - known
    assert isinstance(cfg, Config)
    plan = resolve(LaunchOptions(script="train.py", config_file=str(path), use_slurm=False), environ={})
    assert plan.env["ACCELFN_CONFIG_FILE"] == str(path)
    assert all(plan.source[k] in ("config", "default") for k in plan.source)


def test_the_configs_say_what_they_are_for():
    one = resolve(LaunchOptions(script="t.py", config_file=str(CONFIGS / "one_gpu.yaml")), environ={})
    assert (one.nproc_per_node, one.env["ACCELFN_DEVICE"], one.env["ACCELFN_MIXED_PRECISION"]) == (
        1,
        "cuda",
        "bf16",
    )
    nodes = resolve(
        LaunchOptions(script="t.py", config_file=str(CONFIGS / "multi_node.yaml"), use_slurm=False),
        environ={},
    )
    assert (nodes.min_nodes, nodes.max_nodes, nodes.node_rank, nodes.nproc_per_node) == (2, 2, 0, 8)
    assert nodes.rdzv_endpoint.endswith(":29500") and nodes.max_restarts == 3
    assert load(CONFIGS / "fsdp.yaml").mesh == "fsdp=-1"
    fp8 = resolve(LaunchOptions(script="t.py", config_file=str(CONFIGS / "fp8.yaml")), environ={})
    assert (fp8.env["ACCELFN_FP8_BACKEND"], fp8.env["ACCELFN_FP8_RECIPE"]) == ("torchao", "tensorwise")
    cpu = load(CONFIGS / "cpu.yaml")
    assert (cpu.device, cpu.num_processes, cpu.mixed_precision) == ("cpu", 2, "no")


@pytest.mark.slow
def test_the_cpu_config_launches_two_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ACCELFN_"))}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "accelfn.cli.main", "launch", "--config-file", str(CONFIGS / "cpu.yaml"),
         str(ROOT / "tests" / "workers" / "launch_env.py")],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ENV ")]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert (r["world_size"], r["device"], r["parsed_mesh"], r["mixed_precision"]) == (
            2,
            "cpu",
            {"dp": 2},
            "no",
        )
