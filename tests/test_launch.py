"""`accelfn launch`: real processes over gloo through our launcher, plus how settings are resolved."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from accelfn.launch.config import Config, ConfigError, save
from accelfn.launch.launcher import LaunchOptions, resolve

WORKERS = Path(__file__).parent / "workers"
ROOT = Path(__file__).parent.parent
CLI = [sys.executable, "-m", "accelfn.cli.main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelfn(*args: str, timeout: float = 90, **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ACCELFN_"))}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env, **kw)


def worker_processes(name: str) -> list[int]:
    """PIDs of live processes whose command line mentions ``name`` (psutil, else /proc)."""
    try:
        import psutil
    except ImportError:
        pids = []
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and name in (d / "cmdline").read_text():
                    pids.append(int(d.name))
            except OSError:
                pass
        return pids
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if name in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(p.info["pid"])
    return found


# ---- resolution of settings (no processes) ----


def test_cpu_flag_defaults_to_one_process_and_sets_device():
    plan = resolve(LaunchOptions(script="t.py", cpu=True), environ={})
    assert plan.nproc_per_node == 1
    assert plan.env["ACCELFN_DEVICE"] == "cpu"
    assert (plan.rdzv_backend, plan.rdzv_endpoint) == ("c10d", "localhost:0")


def test_flags_override_the_config_file(tmp_path):
    cfg = save(
        Config(num_processes=3, mixed_precision="fp16", mesh="dp=3", max_restarts=2), tmp_path / "c.yaml"
    )
    plan = resolve(LaunchOptions(script="t.py", config_file=str(cfg), mixed_precision="bf16"), environ={})
    assert plan.nproc_per_node == 3 and plan.max_restarts == 2
    assert plan.env["ACCELFN_MIXED_PRECISION"] == "bf16"
    assert plan.env["ACCELFN_MESH"] == "dp=3"
    assert plan.env["ACCELFN_CONFIG_FILE"] == str(cfg.resolve())
    assert plan.source["mixed_precision"] == "flag" and plan.source["nproc_per_node"] == "config"


def test_default_config_is_read_from_the_cache_folder(tmp_path):
    save(Config(num_processes=2), tmp_path / "accelfn" / "default_config.yaml")
    plan = resolve(LaunchOptions(script="t.py"), environ={"XDG_CACHE_HOME": str(tmp_path)})
    assert plan.nproc_per_node == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--max-restarts", "-1"], "--max-restarts=-1: expected an integer >= 0"),
     (["--monitor-interval", "0"], "--monitor-interval=0.0: expected a positive number"),
     (["--node-rank", "-1"], "--node-rank=-1 must be in [0, --nnodes=1)")],
)  # fmt: skip
def test_bad_launch_flags_exit_2_naming_the_flag(flags, message):
    r = accelfn("launch", "--cpu", *flags, "no_such_script.py", timeout=180)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_num_processes_counts_all_nodes_as_accelerate_does():
    # Accelerate's --num_processes is the total (num_processes // num_machines per node); --nproc-per-node is ours
    plan = resolve(
        LaunchOptions(script="t.py", num_processes=4, nnodes="2", rdzv_endpoint="h:1", cpu=True), environ={}
    )
    assert plan.nproc_per_node == 2 and plan.max_nodes == 2
    assert resolve(LaunchOptions(script="t.py", num_processes=3, cpu=True), environ={}).nproc_per_node == 3
    with pytest.raises(
        ConfigError, match=r"--num-processes=3 \(over all nodes\) does not split evenly over --nnodes=2"
    ):
        resolve(
            LaunchOptions(script="t.py", num_processes=3, nnodes="2", rdzv_endpoint="h:1", cpu=True),
            environ={},
        )
    with pytest.raises(ConfigError, match="--num-processes=0: expected a positive integer"):
        resolve(LaunchOptions(script="t.py", num_processes=0, cpu=True), environ={})
    with pytest.raises(ConfigError, match="give one"):
        resolve(LaunchOptions(script="t.py", num_processes=2, nproc_per_node=2, cpu=True), environ={})
    with pytest.raises(ConfigError, match="elastic"):
        resolve(
            LaunchOptions(script="t.py", num_processes=2, nnodes="1:2", rdzv_endpoint="h:1", cpu=True),
            environ={},
        )


def test_bad_paths_and_a_missing_script_are_one_line_errors(tmp_path):
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match=r"--log-dir=.*afile' is a file; give a folder"):
        resolve(LaunchOptions(script="t.py", cpu=True, log_dir=str(a_file)), environ={})
    with pytest.raises(ConfigError, match="cannot be made"):
        resolve(LaunchOptions(script="t.py", cpu=True, log_dir=str(a_file / "logs")), environ={})
    made = tmp_path / "new" / "logs"
    assert resolve(LaunchOptions(script="t.py", cpu=True, log_dir=str(made)), environ={}).log_dir == str(made)
    assert made.is_dir()
    with pytest.raises(ConfigError, match="is a folder; give the YAML file's path"):
        resolve(LaunchOptions(script="t.py", cpu=True, config_file=str(tmp_path)), environ={})
    r = accelfn("launch", timeout=180)
    assert r.returncode == 2 and r.stderr.strip() == (
        "accelfn launch: error: SCRIPT is required: the training script's path (or a module with -m)"
    ), r.stderr
    r = accelfn("launch", "--cpu", "--log-dir", str(a_file), "t.py", timeout=180)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "is a file" in r.stderr, r.stderr


def test_several_nodes_need_an_endpoint():
    with pytest.raises(ConfigError, match="--rdzv-endpoint"):
        resolve(LaunchOptions(script="t.py", nnodes="2", cpu=True), environ={})


def test_elastic_node_range_is_parsed():
    plan = resolve(LaunchOptions(script="t.py", nnodes="1:4", rdzv_endpoint="h:1", cpu=True), environ={})
    assert (plan.min_nodes, plan.max_nodes, plan.rdzv_id) == (1, 4, "accelfn")


def test_module_target_runs_through_the_bootstrap():
    plan = resolve(
        LaunchOptions(script="pkg.train", module=True, script_args=("--x", "1"), cpu=True), environ={}
    )
    assert plan.args[-4:] == ("-m", "pkg.train", "--x", "1")


def test_bad_mesh_flag_names_the_flag():
    with pytest.raises(ValueError, match="--mesh"):
        resolve(LaunchOptions(script="t.py", mesh="dp:2", cpu=True), environ={})


# ---- real processes ----


@pytest.mark.slow
def test_two_nodes_on_one_machine_form_one_world():
    endpoint = f"127.0.0.1:{free_port()}"
    common = [
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        endpoint,
        "--nproc-per-node",
        "2",
        "--cpu",
        str(WORKERS / "launch_allreduce.py"),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ACCELFN_"))}
    nodes = [
        subprocess.Popen(
            [*CLI, "launch", "--node-rank", str(r), *common],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in (0, 1)
    ]
    outs = [n.communicate(timeout=120)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    lines = sorted(m for out in outs for m in re.findall(r"rank=\d+ world_size=\d+ sum=\d+", out))
    assert len(lines) == 4
    assert all("world_size=4 sum=6" in line for line in lines), lines
    assert {line.split()[0] for line in lines} == {"rank=0", "rank=1", "rank=2", "rank=3"}


@pytest.mark.slow
def test_failing_rank_stops_the_job_and_is_named():
    script = str(WORKERS / "launch_fail.py")
    start = time.monotonic()
    r = accelfn("launch", "--nproc-per-node", "2", "--cpu", script, timeout=180)
    elapsed, end = time.monotonic() - start, time.time()
    assert r.returncode != 0
    assert elapsed < 45, elapsed  # no hang (about 10 s alone; two test files run at once in CI)
    raised = float(next(line for line in r.stdout.splitlines() if line.startswith("RAISING at ")).split()[-1])
    assert end - raised < 10, end - raised  # every rank stopped, launcher done, seconds after the raise
    assert "accelfn launch: rank 1 failed: ValueError: boom" in r.stderr, r.stderr
    assert 'raise ValueError("boom")' in r.stderr  # its traceback
    time.sleep(0.5)
    assert worker_processes(script) == []


@pytest.mark.slow
def test_exit_codes_signals_and_main_process_first_failures_are_reported(tmp_path):
    # a rank that exits with a code (no Python exception) is reported by its code, not "<NONE>"; a main
    # process whose main_process_first() block raises does not let the others in
    script = tmp_path / "exits.py"
    script.write_text(
        "import sys, torch, accelfn as af\n"
        "mesh = af.Mesh.from_env(device='cpu')\n"
        "if sys.argv[1] == 'code':\n"
        "    af.dist.barrier()\n"
        "    sys.exit(3 if mesh.rank == 1 else 0)\n"
        "with af.dist.main_process_first():\n"
        "    if mesh.rank == 0:\n"
        "        raise OSError('download failed')\n"
        "    print('ENTERED after a failed main', flush=True)\n"
    )
    r = accelfn("launch", "--nproc-per-node", "2", "--cpu", str(script), "code", timeout=180)
    assert r.returncode != 0 and "rank 1 failed: exited with code 3" in r.stderr, r.stderr
    assert "<NONE>" not in r.stderr
    r = accelfn("launch", "--nproc-per-node", "2", "--cpu", str(script), "first", timeout=180)
    assert r.returncode != 0 and "rank 0 failed: OSError: download failed" in r.stderr, r.stderr
    assert "ENTERED" not in r.stdout


@pytest.mark.slow
def test_workers_do_not_outlive_a_killed_launcher(tmp_path):
    import signal

    script = tmp_path / "sleeper.py"
    script.write_text("import time, accelfn as af\nmesh = af.Mesh.from_env(device='cpu')\nprint('UP', flush=True)\n"
                      "time.sleep(60)\n")  # fmt: skip
    proc = subprocess.Popen([*CLI, "launch", "--nproc-per-node", "2", "--cpu", str(script)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip

    def workers():
        return [pid for pid in worker_processes(str(script)) if pid != proc.pid]

    deadline = time.monotonic() + 60
    while len(workers()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(workers()) == 2
    proc.send_signal(signal.SIGKILL)  # as the OOM killer or `timeout -s KILL` would
    proc.wait(10)
    deadline = time.monotonic() + 10
    while workers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert workers() == []


@pytest.mark.slow
def test_a_new_mesh_after_close_works_in_a_launched_job():
    # The destroyed group's keys stay in the launcher's store; a new group must not read them (it hung or
    # was refused in 6 of 8 runs before each group got its own key prefix).
    for _ in range(3):
        r = accelfn("launch", "--nproc-per-node", "2", "--cpu", str(WORKERS / "mesh_reuse.py"), timeout=180)
        assert r.returncode == 0 and r.stdout.count("REUSE OK") == 2, r.stderr


@pytest.mark.slow
def test_max_restarts_restarts_the_group(tmp_path):
    marker = tmp_path / "failed-once"
    r = accelfn(
        "launch",
        "--nproc-per-node",
        "2",
        "--cpu",
        "--max-restarts",
        "1",
        str(WORKERS / "launch_fail.py"),
        "--marker",
        str(marker),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert marker.exists()
    # two processes share one stdout, so lines may interleave: find the records anywhere
    assert sorted(re.findall(r"rank=\d+ ok restart=\d+", r.stdout)) == [
        "rank=0 ok restart=1",
        "rank=1 ok restart=1",
    ]


@pytest.mark.slow
def test_mesh_and_mixed_precision_reach_the_workers():
    r = accelfn(
        "launch",
        "--nproc-per-node",
        "2",
        "--cpu",
        "--mesh",
        "dp=2,tp=1",
        "--mixed-precision",
        "bf16",
        str(WORKERS / "launch_env.py"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    seen = [json.loads(line[4:]) for line in r.stdout.splitlines() if line.startswith("ENV ")]
    assert sorted(e["rank"] for e in seen) == [0, 1]
    for e in seen:
        assert e["mesh"] == "dp=2,tp=1" and e["parsed_mesh"] == {"dp": 2, "tp": 1}
        assert (e["mixed_precision"], e["device"], e["launched"], e["world_size"]) == ("bf16", "cpu", True, 2)


@pytest.mark.slow
def test_selftest_passes_on_two_cpu_processes():
    r = accelfn("test", "--nproc-per-node", "2", "--cpu", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "3 DDP steps == 1 process on the global batch" in r.stdout
    assert "accelfn test: PASS" in r.stdout


@pytest.mark.slow
def test_an_accelfn_script_runs_unchanged_under_the_deepspeed_launcher():
    """DeepSpeed's own launcher (multi-node: `deepspeed --hostfile`, over ssh) sets torch's variables."""
    pytest.importorskip("deepspeed")
    script = str(WORKERS / "under_deepspeed_launcher.py")
    args = ["--num_gpus", "2", "--master_port", str(free_port()), script]
    env = {**os.environ, "ACCELFN_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", "deepspeed.launcher.runner", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "OK under the deepspeed launcher: world 2" in r.stdout, r.stdout[-2000:]


@pytest.mark.slow
def test_rich_tracebacks_on_request_stay_the_last_thing_the_launcher_prints(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text('def f(x):\n    y = x * 2\n    raise ValueError(f"bad {y}")\n\n\nf(3)\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ACCELFN_"))}
    plain = subprocess.run([*CLI, "launch", "--nproc-per-node", "1", "--cpu", str(script)], capture_output=True,
                           text=True, timeout=180, env=env)  # fmt: skip
    rich = subprocess.run([*CLI, "launch", "--nproc-per-node", "1", "--cpu", str(script)], capture_output=True,
                          text=True, timeout=180, env={**env, "ACCELFN_RICH": "1"})  # fmt: skip
    assert plain.returncode != 0 and rich.returncode != 0
    assert "Traceback (most recent call last)" in plain.stderr and "╭" not in plain.stderr
    tail = rich.stderr.rstrip().splitlines()
    assert tail[-1].strip() == "ValueError: bad 6", rich.stderr[
        -2000:
    ]  # the failing rank's traceback comes last
    report = rich.stderr[rich.stderr.index("accelfn launch: rank 0 failed") :]
    assert "Traceback (most recent call last)" in report and "╭" in report  # rich's boxed rendering
    assert '❱ 3 │   raise ValueError(f"bad {y}")' in report  # with the source line of each frame


@pytest.mark.slow
def test_the_failing_ranks_traceback_stays_last_with_trackers_running(tmp_path):
    script = tmp_path / "fails_while_logging.py"
    script.write_text(
        "import torch, accelfn as af\n"
        "mesh = af.Mesh.from_env()\n"
        f"run = af.trackers.open({str(tmp_path / 'run')!r}, 'auto', mesh=mesh)\n"
        "for i in range(5):\n"
        "    run.log({'loss': torch.tensor(1.0 / (i + 1))}, step=i + 1)\n"
        "run.flush()\n"
        "if mesh.rank == 1:\n"
        "    raise ValueError('rank one fails')\n"
        "mesh.close()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ACCELFN_"))}
    r = subprocess.run([*CLI, "launch", "--nproc-per-node", "2", "--cpu", "--log-with", "jsonl,tensorboard",
                        str(script)], capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert r.returncode != 0
    assert "accelfn launch: rank 1 failed: ValueError: rank one fails" in r.stderr, r.stderr[-3000:]
    last = [line for line in r.stderr.rstrip().splitlines() if line.strip()][-1]
    assert last.strip() == "ValueError: rank one fails", r.stderr[-3000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()  # written by rank 0 only
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5]


def test_the_root_cause_is_named_first_when_a_peer_dies_of_it_in_the_same_second(tmp_path):
    # torch orders failures by whole-second timestamps and breaks ties by rank: rank 0, which died of
    # rank 1's crash ("Connection closed by peer"), was named as the cause (a CI flake)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from accelfn.launch.launcher import _failure_report

    def failure(rank: int, message: str, mtime_ns: int) -> ProcessFailure:
        path = tmp_path / f"error_{rank}.json"
        data = {"message": message, "extraInfo": {"py_callstack": f"Traceback {rank}", "timestamp": "100"}}
        path.write_text(json.dumps({"message": data}))
        os.utime(path, ns=(mtime_ns, mtime_ns))
        return ProcessFailure(local_rank=rank, pid=10 + rank, exitcode=1, error_file=str(path))

    peer = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:20367."
    # same second, the cause wrote its error file first
    err = ChildFailedError(
        "w", {0: failure(0, peer, 2_000_000_000), 1: failure(1, "ValueError: boom", 1_000)}
    )
    assert err.get_first_failure()[0] == 0  # torch's choice: the tie goes to rank 0
    report = _failure_report(err)
    assert "rank 1 failed: ValueError: boom" in report
    assert "rank 0 also failed (after rank 1, below)" in report
    assert report.rstrip().endswith("Traceback 1")
    # a peer-connection error is a consequence even when its file is older
    err = ChildFailedError("w", {0: failure(0, peer, 1_000), 1: failure(1, "ValueError: boom", 2_000)})
    assert "rank 1 failed: ValueError: boom" in _failure_report(err)
    # otherwise the earlier error file wins, whatever the rank
    err = ChildFailedError("w", {0: failure(0, "KeyError: b", 2_000), 1: failure(1, "OSError: a", 1_000)})
    assert "rank 1 failed: OSError: a" in _failure_report(err)
    err = ChildFailedError("w", {0: failure(0, "KeyError: b", 1_000), 1: failure(1, "OSError: a", 2_000)})
    assert "rank 0 failed: KeyError: b" in _failure_report(err)
    # a rank stopped by the agent's SIGTERM (no error file) comes after one that exited with a code, and
    # after one killed by another signal (the OOM killer's SIGKILL)
    stopped = ProcessFailure(local_rank=0, pid=10, exitcode=-15, error_file=str(tmp_path / "none_0.json"))
    for code, words in ((3, "exited with code 3"), (-9, "killed by signal SIGKILL")):
        other = ProcessFailure(local_rank=1, pid=11, exitcode=code, error_file=str(tmp_path / "none_1.json"))
        other.timestamp = stopped.timestamp + 1  # even when torch stamps it later
        report = _failure_report(ChildFailedError("w", {0: stopped, 1: other}))
        assert f"rank 1 failed: {words}" in report and "rank 0 also failed (after rank 1" in report, report
