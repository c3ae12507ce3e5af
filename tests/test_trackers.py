"""accelfn.trackers: each backend round-trips through its own reader; buffering, resume, errors, ranks."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import os
import pathlib
import subprocess
import sys

import attrs
import pytest
import torch
from _launch import ROOT, output_of, run_workers

from accelfn import launch_env, trackers
from accelfn.launch.config import Config, ConfigError, load, save
from accelfn.launch.launcher import LaunchOptions, resolve
from accelfn.trackers import TrackerError


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Tests run inside whatever environment pytest was started in (maybe under a launcher)."""
    for name in ("RANK", "ACCELFN_LOG_WITH", "WANDB_MODE", "WANDB_API_KEY", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)


def jsonl(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(steps: range) -> dict[int, float]:
    return {s: 1.0 / s for s in steps}


def log_steps(run: trackers.Run, steps: range) -> None:
    for s in steps:
        run.log({"loss": torch.tensor(1.0 / s, dtype=torch.float64), "tokens": torch.tensor(s * 100)}, step=s)


# ---- JSONL, buffering ---------------------------------------------------------------------------------------------
def test_jsonl_has_one_line_per_logged_step_with_its_values_and_the_config(tmp_path):
    with trackers.open(tmp_path, config={"lr": 1e-3, "dims": [4, 8]}, log_every=4) as run:
        log_steps(run, range(1, 11))
        run.log({"epoch": 1, "acc": 0.5}, step=11)
    lines = jsonl(tmp_path)
    assert [ln["step"] for ln in lines] == list(range(1, 12))
    assert {ln["step"]: ln["loss"] for ln in lines[:10]} == losses(range(1, 11))
    assert [ln["tokens"] for ln in lines[:10]] == [s * 100 for s in range(1, 11)]  # integer tensors stay ints
    assert all(isinstance(ln["tokens"], int) for ln in lines[:10])
    assert lines[-1] == {"step": 11, "time": lines[-1]["time"], "epoch": 1, "acc": 0.5}
    assert json.loads((tmp_path / "config.json").read_text()) == {"lr": 1e-3, "dims": [4, 8]}


class CountReads:
    """Counts every way a tensor's value reaches Python (each one a device sync on an accelerator)."""

    METHODS = ("tolist", "item", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu")

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _name=name, _original=original, **k):
                self.calls.append(_name)
                return _original(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_tensor_metrics_are_read_once_per_flush_not_once_per_step(tmp_path, monkeypatch):
    run = trackers.open(tmp_path, log_every=5)
    reads = CountReads(monkeypatch)
    step = torch.zeros((), dtype=torch.int64)
    for s in range(1, 13):
        step += 1  # as state.step: a tensor updated in place
        run.log({"loss": torch.tensor(1.0 / s), "grad_norm": torch.tensor(2.0 * s)}, step=step)
        expected = s // 5  # one read per 5 logs, whatever the number of metrics
        assert reads.calls == ["tolist"] * expected, (s, reads.calls)
    run.close()  # the 2 buffered lines: one more read
    assert reads.calls == ["tolist"] * 3
    lines = jsonl(tmp_path)
    assert [ln["step"] for ln in lines] == list(range(1, 13))
    assert [ln["grad_norm"] for ln in lines] == [2.0 * s for s in range(1, 13)]


@pytest.mark.gpu
def test_logging_cuda_metrics_does_not_synchronize_until_the_flush(tmp_path):
    run = trackers.open(tmp_path, log_every=4)
    step = torch.zeros((), dtype=torch.int64, device="cuda")
    loss, lr = torch.ones((), device="cuda"), torch.tensor(0.1, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call raises
    try:
        for _ in range(3):
            step += 1
            loss.mul_(0.5)
            run.log({"loss": loss, "lr": lr, "epoch": 0}, step=step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    run.close()
    assert [(ln["step"], ln["loss"]) for ln in jsonl(tmp_path)] == [(1, 0.5), (2, 0.25), (3, 0.125)]


def test_values_are_those_at_log_time_even_if_the_tensors_change_later(tmp_path):
    lr = torch.tensor(0.1)  # like the optimizer state's lr: updated in place by the next step
    with trackers.open(tmp_path, log_every=10) as run:
        for s in range(1, 4):
            run.log({"lr": lr}, step=s)
            lr.mul_(0.5)
    assert [ln["lr"] for ln in jsonl(tmp_path)] == pytest.approx([0.1, 0.05, 0.025])


def test_an_exception_in_the_with_block_still_writes_the_buffered_lines(tmp_path):
    with pytest.raises(KeyError), trackers.open(tmp_path, log_every=100) as run:
        log_steps(run, range(1, 4))
        raise KeyError("training failed")
    assert [ln["step"] for ln in jsonl(tmp_path)] == [1, 2, 3]


def test_buffered_lines_are_written_at_interpreter_exit(tmp_path):
    code = (
        "import sys, torch; from accelfn import trackers\n"
        "run = trackers.open(sys.argv[1], log_every=100)\n"
        "for s in (1, 2, 3): run.log({'loss': torch.tensor(float(s))}, step=s)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert [ln["loss"] for ln in jsonl(tmp_path)] == [1.0, 2.0, 3.0]


def test_bad_metrics_are_errors_naming_the_metric(tmp_path):
    with trackers.open(tmp_path) as run:
        with pytest.raises(ValueError, match=r"metric 'logits' is a tensor of shape \(2, 3\)"):
            run.log({"logits": torch.zeros(2, 3)}, step=1)
        with pytest.raises(TypeError, match="metric 'name' is a str"):
            run.log({"name": "x"}, step=1)
        with pytest.raises(ValueError, match="metric name 'step'"):
            run.log({"step": 1}, step=1)
        with pytest.raises(TypeError, match="step must be an int"):
            run.log({"loss": 1.0}, step=torch.tensor(1.5))


def test_a_custom_tracker_gets_numbers_in_order_and_the_wall_time_if_it_asks(tmp_path):
    class Plain:
        def __init__(self):
            self.lines, self.config, self.closed = [], None, False

        def log(self, metrics, step):
            self.lines.append((step, metrics))

        def log_config(self, config):
            self.config = config

        def close(self):
            self.closed = True

    class Timed(Plain):
        def log(self, metrics, step, *, wall_time=None):
            self.lines.append((step, wall_time))

    plain, timed = Plain(), Timed()
    assert isinstance(plain, trackers.Tracker)
    with trackers.open(tmp_path, [plain, timed, "jsonl"], config={"a": 1}) as run:
        run.log({"loss": torch.tensor(0.5), "n": 3}, step=7)
    assert plain.lines == [(7, {"loss": 0.5, "n": 3})] and plain.config == {"a": 1} and plain.closed
    assert timed.lines == [(7, jsonl(tmp_path)[0]["time"])]


# ---- config flattening ----------------------------------------------------------------------------------------------
class Kind(enum.Enum):
    A = "a"


@dataclasses.dataclass
class Optim:
    lr: float = 1e-3
    betas: tuple = (0.9, 0.95)
    schedule: None = None


@attrs.define
class Model:
    dims: list = attrs.Factory(lambda: [64, 128])
    dtype: torch.dtype = torch.bfloat16
    extra: dict = attrs.Factory(dict)


def test_flatten_config_turns_any_nesting_into_dotted_scalar_keys():
    config = argparse.Namespace(
        optim=Optim(),
        model=Model(),
        out=pathlib.Path("/tmp/run"),
        kind=Kind.A,
        resume=None,
        seeds=[],
        fp16=True,
    )
    assert trackers.flatten_config(config) == {
        "optim.lr": 1e-3, "optim.betas.0": 0.9, "optim.betas.1": 0.95, "optim.schedule": "None",
        "model.dims.0": 64, "model.dims.1": 128, "model.dtype": "torch.bfloat16", "model.extra": "{}",
        "out": "/tmp/run", "kind": "a", "resume": "None", "seeds": "[]", "fp16": True,
    }  # fmt: skip
    assert all(isinstance(v, (str, int, float, bool)) for v in trackers.flatten_config(config).values())


# ---- backends, read back with their own readers ------------------------------------------------------------------
def tensorboard_scalars(log_dir: pathlib.Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_events_read_back_with_the_logged_steps_values_and_hparams(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    with trackers.open(tmp_path, "tensorboard", config={"opt": Optim(), "seed": None}, log_every=3) as run:
        log_steps(run, range(1, 8))
    scalars = tensorboard_scalars(tmp_path / "tensorboard", "loss")
    assert [s for s, _ in scalars] == list(range(1, 8))
    assert [v for _, v in scalars] == pytest.approx([1.0 / s for s in range(1, 8)])
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["opt.lr"].number_value == pytest.approx(1e-3) and hparams["seed"].string_value == "None"


def test_mlflow_run_reads_back_with_mlflowclient_and_resumes_the_same_run(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    with trackers.open(tmp_path, "mlflow", config={"opt": Optim()}, log_every=4) as run:
        log_steps(run, range(1, 7))
        first_id = run.trackers[0].run_id
    with trackers.open(tmp_path, "mlflow", resume_step=6) as run:
        log_steps(run, range(7, 9))
        assert run.trackers[0].run_id == first_id
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}")
    history = client.get_metric_history(first_id, "loss")
    assert sorted((m.step, m.value) for m in history) == sorted(losses(range(1, 9)).items())
    finished = client.get_run(first_id)
    assert finished.info.status == "FINISHED" and finished.data.params["opt.betas.1"] == "0.95"


def wandb_history(run_file: pathlib.Path) -> list[dict]:
    """The history rows of a `.wandb` file (LevelDB log format: 7-byte record headers in 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, buf, rows = run_file.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B", data[:8]
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record.FromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                )
    return rows


def test_wandb_runs_offline_without_a_key_and_its_history_reads_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    with trackers.open(run_dir, "wandb", config={"opt": Optim()}, log_every=4) as run:
        assert run.trackers[0].mode == "offline"
        log_steps(run, range(1, 6))
        run_id = run.trackers[0].run_id
    with trackers.open(run_dir, "wandb", resume_step=5) as run:
        assert run.trackers[0].run_id == run_id  # the same W&B run continues
        log_steps(run, range(6, 8))
    # one offline-run-<time>-<id> folder per attempt (wandb adds "-1" when both started in the same second)
    files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))
    assert len(files) == 2, list((run_dir / "wandb").iterdir())
    rows = [r for f in files for r in wandb_history(f)]
    assert {r["_step"]: r["loss"] for r in rows} == losses(range(1, 8))


def test_trackio_run_reads_back_from_its_local_store(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is first imported
    pytest.importorskip("trackio")
    from trackio.sqlite_storage import SQLiteStorage

    project = f"accelfn-test-{tmp_path.name}"
    with trackers.open(
        tmp_path / "run", "trackio", {"lr": 0.1}, options={"trackio": {"project": project}}
    ) as run:
        log_steps(run, range(1, 5))
    logs = SQLiteStorage.get_logs(project, "run")
    assert {r["step"]: r["loss"] for r in logs} == losses(range(1, 5))


# ---- resume -------------------------------------------------------------------------------------------------------------
def test_a_resumed_run_continues_the_numbering_in_jsonl_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    with trackers.open(tmp_path, ["jsonl", "tensorboard"], log_every=3) as run:
        log_steps(run, range(1, 11))  # crashed after step 10; the last checkpoint is step 6
    with trackers.open(tmp_path, "jsonl,tensorboard", resume_step=6, log_every=3) as run:
        log_steps(run, range(7, 13))
    assert [ln["step"] for ln in jsonl(tmp_path)] == list(range(1, 13))
    assert {ln["step"]: ln["loss"] for ln in jsonl(tmp_path)} == losses(range(1, 13))
    scalars = tensorboard_scalars(tmp_path / "tensorboard", "loss")
    assert [s for s, _ in scalars] == list(range(1, 13))
    assert [v for _, v in scalars] == pytest.approx(list(losses(range(1, 13)).values()))


def test_resume_drops_a_line_torn_by_a_crash(tmp_path):
    with trackers.open(tmp_path) as run:
        log_steps(run, range(1, 4))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')
    with trackers.open(tmp_path, resume_step=3) as run:
        log_steps(run, range(4, 5))
    assert [ln["step"] for ln in jsonl(tmp_path)] == [1, 2, 3, 4]


# ---- errors ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["jsonl", "tensorboard"])
def test_an_unwritable_folder_is_one_error_at_open_naming_the_backend(tmp_path, backend):
    pytest.importorskip("tensorboard")
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(TrackerError, match=rf"tracker '{backend}': cannot write .*file/run") as info:
        trackers.open(tmp_path / "file" / "run", backend)
    assert info.value.backend == backend


def test_a_missing_package_is_one_error_naming_the_extras(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(TrackerError) as info:
        trackers.open(tmp_path, "jsonl,wandb,mlflow")
    assert str(info.value) == (
        "tracker 'wandb, mlflow': not installed (no module 'wandb', 'mlflow'); install with "
        "pip install 'accelfn[wandb,mlflow]'"
    )
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing was opened


def test_a_missing_package_imported_by_the_backend_names_the_extra(tmp_path, monkeypatch):
    from accelfn.trackers.wandb import WandbTracker

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(TrackerError, match=r"tracker 'wandb': .*pip install 'accelfn\[wandb\]'"):
        WandbTracker(tmp_path)


def test_a_tracker_failing_while_logging_is_reported_once_and_the_others_keep_logging(tmp_path):
    class Broken:
        name = "broken"

        def log(self, metrics, step):
            raise OSError("disk full")

        def log_config(self, config):
            pass

        def close(self):
            pass

    run = trackers.open(tmp_path, ["jsonl", Broken()], log_every=2)
    run.log({"loss": torch.tensor(1.0)}, step=1)
    with pytest.raises(TrackerError, match=r"tracker 'broken': failed while writing steps 1..2: OSError: disk full; "
                       r"it is no longer written to \(still written to: 'jsonl'\)"):  # fmt: skip
        run.log({"loss": torch.tensor(0.5)}, step=2)
    log_steps(run, range(3, 6))  # no second error
    run.close()
    assert [ln["step"] for ln in jsonl(tmp_path)] == [1, 2, 3, 4, 5]


def test_on_error_warn_keeps_training_going_with_a_warning(tmp_path):
    class Broken:
        def log(self, metrics, step):
            raise RuntimeError("server gone")

        log_config = close = lambda self, *a: None  # noqa: E731

    warns = pytest.warns(UserWarning, match="tracker 'Broken': .*RuntimeError: server gone")
    with warns, trackers.open(tmp_path, ["jsonl", Broken()], log_every=1, on_error="warn") as run:
        log_steps(run, range(1, 3))
    assert len(jsonl(tmp_path)) == 2


def test_unknown_tracker_names_are_errors_listing_the_known_ones(tmp_path):
    with pytest.raises(
        ValueError, match="unknown tracker 'tensorbord'; known: jsonl, tensorboard, wandb, mlflow"
    ):
        trackers.open(tmp_path, "jsonl,tensorbord")
    with pytest.raises(TypeError, match="'object' is not a tracker: it has no method"):
        trackers.open(tmp_path, [object()])


# ---- ranks, auto, the launcher ----------------------------------------------------------------------------------------
def test_other_ranks_get_a_run_that_accepts_the_calls_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with trackers.open(tmp_path / "run", "jsonl,tensorboard", config={"a": 1}) as run:
        log_steps(run, range(1, 30))
        assert not run.active and run.trackers == ()
    assert not (tmp_path / "run").exists()


def test_main_only_false_gives_each_rank_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    with trackers.open(tmp_path, main_only=False) as run:
        log_steps(run, range(1, 3))
    assert [ln["step"] for ln in jsonl(tmp_path / "rank3")] == [1, 2]


def test_auto_reads_the_launcher_variable_else_jsonl(monkeypatch):
    assert trackers.parse_log_with("auto") == ["jsonl"]
    monkeypatch.setenv("ACCELFN_LOG_WITH", "tensorboard,jsonl")
    assert trackers.parse_log_with("auto") == ["tensorboard", "jsonl"]
    monkeypatch.setenv("ACCELFN_LOG_WITH", "none")
    assert trackers.parse_log_with("auto") == []
    monkeypatch.setenv("ACCELFN_LOG_WITH", "tb")
    with pytest.raises(ValueError, match="ACCELFN_LOG_WITH='tb': unknown tracker 'tb'"):
        trackers.parse_log_with("auto")


def test_the_backend_registry_matches_the_launcher_contract():
    assert tuple(trackers.BACKENDS) == launch_env.TRACKERS
    assert launch_env.ACCELFN_LOG_WITH in launch_env.ACCELFN_VARIABLES


def test_log_with_flag_and_config_key_reach_the_worker_environment(tmp_path):
    plan = resolve(LaunchOptions(script="t.py", cpu=True, log_with="TensorBoard, jsonl"), environ={})
    assert plan.env["ACCELFN_LOG_WITH"] == "tensorboard,jsonl"
    assert "ACCELFN_LOG_WITH" not in resolve(LaunchOptions(script="t.py", cpu=True), environ={}).env
    path = save(Config(log_with=["wandb", "jsonl"]), tmp_path / "c.yaml")
    assert load(path).log_with == "wandb,jsonl"
    plan = resolve(LaunchOptions(script="t.py", cpu=True, config_file=str(path)), environ={})
    assert plan.env["ACCELFN_LOG_WITH"] == "wandb,jsonl" and plan.source["log_with"] == "config"
    plan = resolve(LaunchOptions(script="t.py", cpu=True, config_file=str(path), log_with="none"), environ={})
    assert plan.env["ACCELFN_LOG_WITH"] == "none"
    assert launch_env.read_env({"ACCELFN_LOG_WITH": "mlflow"}).log_with == ("mlflow",)


def test_a_bad_log_with_names_the_flag_or_the_config_key(tmp_path):
    with pytest.raises(ValueError, match="--log-with='jsonl,neptune': unknown tracker 'neptune'"):
        resolve(LaunchOptions(script="t.py", cpu=True, log_with="jsonl,neptune"), environ={})
    (tmp_path / "c.yaml").write_text("log_with: [jsonl, tb]\n")
    with pytest.raises(ConfigError, match="config key 'log_with'='jsonl,tb': unknown tracker 'tb'"):
        load(tmp_path / "c.yaml")


@pytest.mark.slow
def test_under_the_launcher_exactly_one_process_writes_with_the_trackers_it_was_given(tmp_path):
    pytest.importorskip("tensorboard")
    if os.environ.get("ACCELFN_TEST_TORCHRUN") == "1":
        pytest.skip("--log-with is an `accelfn launch` option")
    proc = run_workers(
        "trackers_worker.py", 2, str(tmp_path), launch_args=("--log-with", "jsonl,tensorboard")
    )
    assert proc.returncode == 0, output_of(proc)
    infos = sorted((json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
                    if line.startswith("TRACKERS ")), key=lambda i: i["rank"])  # fmt: skip
    assert infos == [
        {"rank": 0, "active": True, "trackers": ["jsonl", "tensorboard"], "env": "jsonl,tensorboard"},
        {"rank": 1, "active": False, "trackers": [], "env": "jsonl,tensorboard"},
    ], output_of(proc)
    lines = jsonl(tmp_path)
    assert [ln["step"] for ln in lines] == list(range(1, 8)) and {ln["rank"] for ln in lines} == {0}
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert [s for s, _ in tensorboard_scalars(tmp_path / "tensorboard", "loss")] == list(range(1, 8))
    assert json.loads((tmp_path / "config.json").read_text()) == {"world_size": 2}


def test_nested_metric_dicts_are_logged_under_slash_joined_names(tmp_path):
    # Accelerate's `accelerator.log({"eval": {"loss": ...}})` habit: TensorBoard/W&B sections, eval/loss
    with trackers.open(tmp_path, log_with=["jsonl", "tensorboard"]) as run:
        run.log({"eval": {"loss": torch.tensor(0.5), "acc": {"top1": 0.25}}, "lr": 1e-3}, step=1)
    line = jsonl(tmp_path)[0]
    assert {k: line[k] for k in ("eval/loss", "eval/acc/top1", "lr")} == {
        "eval/loss": 0.5,
        "eval/acc/top1": 0.25,
        "lr": 1e-3,
    }
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next(tmp_path.rglob("events.out.tfevents.*")).parent))
    events.Reload()
    assert {"eval/loss", "eval/acc/top1", "lr"} <= set(events.Tags()["scalars"])
