"""SLURM front-end: nodelist expansion and the launcher's derived arguments (no processes)."""

from __future__ import annotations

import pytest

from accelfn.launch.launcher import LaunchOptions, resolve
from accelfn.launch.slurm import expand_nodelist, from_env

JOB = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NNODES": "4",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NODELIST": "node[01-04]",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_LOCALID": "0",
}


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-04]", ["node01", "node02", "node03", "node04"]),
        ("gpu[8-10,12]", ["gpu8", "gpu9", "gpu10", "gpu12"]),
        ("a[1-2],b3,c[07-08]", ["a1", "a2", "b3", "c07", "c08"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ],
)
def test_nodelist_expands_like_scontrol(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_bad_nodelist_names_itself():
    with pytest.raises(ValueError, match="node\\[01-"):
        expand_nodelist("node[01-")


def test_slurm_variables_give_nodes_rank_id_and_endpoint():
    s = from_env(JOB)
    assert s is not None
    assert (s.nnodes, s.node_rank, s.rdzv_id, s.rdzv_endpoint) == (4, 2, "4242", "node01:29500")


def test_outside_slurm_nothing_is_derived():
    assert from_env({}) is None


def test_launcher_uses_the_slurm_allocation():
    plan = resolve(LaunchOptions(script="train.py", cpu=True), environ=JOB)
    assert (plan.min_nodes, plan.max_nodes, plan.node_rank) == (4, 4, 2)
    assert (plan.rdzv_id, plan.rdzv_endpoint, plan.rdzv_backend) == ("4242", "node01:29500", "c10d")
    assert plan.nproc_per_node == 1 and plan.source["nnodes"] == "slurm"


def test_a_one_node_job_gets_a_private_store_and_a_config_endpoint_wins(tmp_path):
    one = {**JOB, "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "node07"}
    plan = resolve(LaunchOptions(script="train.py", cpu=True), environ=one)
    assert plan.rdzv_endpoint == "localhost:0"  # like torchrun --standalone: two jobs on a node never collide
    with pytest.raises(ValueError, match="MASTER_PORT='abc' is not a port number"):
        from_env({**JOB, "MASTER_PORT": "abc"})


def test_master_port_and_gpus_on_node_are_honoured():
    s = from_env({**JOB, "MASTER_PORT": "6000", "SLURM_GPUS_ON_NODE": "8", "SLURM_STEP_NODELIST": "x[5-8]"})
    assert s is not None and (s.rdzv_endpoint, s.nproc_per_node) == ("x5:6000", 8)


def test_flags_override_slurm():
    plan = resolve(
        LaunchOptions(
            script="t.py", nnodes="2", node_rank=1, rdzv_endpoint="h:1", cpu=True, nproc_per_node="2"
        ),
        environ=JOB,
    )
    assert (plan.max_nodes, plan.node_rank, plan.rdzv_endpoint, plan.nproc_per_node) == (2, 1, "h:1", 2)
    assert plan.rdzv_id == "4242"


def test_no_slurm_flag_ignores_the_allocation():
    plan = resolve(LaunchOptions(script="t.py", cpu=True, use_slurm=False), environ=JOB)
    assert plan.max_nodes == 1


def test_second_launcher_on_a_node_is_refused():
    with pytest.raises(ValueError, match="SLURM_LOCALID=1"):
        from_env({**JOB, "SLURM_LOCALID": "1"})
