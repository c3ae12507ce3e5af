"""Comet, Aim, ClearML, DVCLive and SwanLab (the trackers Accelerate has beyond the first four), ``log_with="all"``
and non-finite values in JSONL.

Each backend writes a run in a fresh process — offline, with a home folder of its own (no credentials) and the
network blocked (any attempt is recorded and fails the test) — and the test reads it back with the package's own
reader. A fresh process also keeps these packages' process-wide hooks (ClearML's, Comet's) out of pytest.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from _launch import ROOT

from accelfn import launch_env, trackers
from accelfn.cli.plot import read_metrics
from accelfn.launch.config import Config, ConfigError, load, save
from accelfn.launch.launcher import LaunchOptions, resolve
from accelfn.trackers import TrackerError

NEW = ("comet_ml", "aim", "clearml", "dvclive", "swanlab")

# Run first in the writing process: every connection or name lookup off this machine is recorded and refused.
NETWORK_GUARD = r"""
import socket
ATTEMPTS = []
_LOCAL = ("localhost", "127.0.0.1", "::1", "0.0.0.0", "", None)


def _local(address):
    return not isinstance(address, tuple) or address[0] in _LOCAL or str(address[0]).startswith("127.")


def _guard(original, what):
    def connect(self, address):
        if self.family == socket.AF_UNIX or _local(address):
            return original(self, address)
        ATTEMPTS.append(f"{what} {address!r}")
        raise OSError(f"network blocked by the test: {what} {address!r}")

    return connect


def _lookup(original, what):
    def lookup(host, *args, **kwargs):
        if host in _LOCAL or str(host).startswith("127.") or host == socket.gethostname():
            return original(host, *args, **kwargs)
        ATTEMPTS.append(f"{what} {host!r}")
        raise socket.gaierror(socket.EAI_NONAME, f"network blocked by the test: {what} {host!r}")

    return lookup


socket.socket.connect = _guard(socket.socket.connect, "connect")
socket.socket.connect_ex = _guard(socket.socket.connect_ex, "connect_ex")
socket.getaddrinfo = _lookup(socket.getaddrinfo, "getaddrinfo")
socket.gethostbyname = _lookup(socket.gethostbyname, "gethostbyname")
"""

WRITER = r"""
import json, sys, torch
from accelfn import trackers

spec = json.loads(sys.argv[1])
infos = []
for attempt, (first, last, resume_step) in enumerate(spec["attempts"], 1):
    with trackers.open(spec["run_dir"], spec["backend"], config=spec["config"], resume_step=resume_step,
                       log_every=3, options=spec["options"]) as run:
        for s in range(first, last + 1):
            run.log({"loss": torch.tensor(1.0 / s, dtype=torch.float64), "eval": {"loss": 2.0 / s},
                     "tokens": torch.tensor(100 * s), "attempt": attempt, "nonfinite": float("nan")}, step=s)
        infos.append({t.name: {k: str(v) for k, v in vars(t).items() if not k.startswith("_")}
                      for t in run.trackers})
with open(spec["result"], "w") as f:  # not stdout: some trackers capture it
    json.dump({"infos": infos, "attempts": ATTEMPTS}, f)
print("stdout still works", flush=True)  # trackers that wrap sys.stdout gave it back
"""

CONFIG = {"lr": 1e-3, "opt": {"betas": [0.9, 0.95]}, "seed": 3}


def losses(steps) -> dict[int, float]:
    return {s: 1.0 / s for s in steps}


def offline_env(tmp_path: pathlib.Path) -> dict[str, str]:
    """The writer's environment: no credentials, a home folder of its own, every tracker offline and fast."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    (home / "clearml.conf").write_text(
        # ClearML's reporting subprocess makes an offline close wait 10 s; threads are as good here
        "sdk.development.report_use_subprocess: false\nsdk.development.worker.report_period_sec: 1\n"
    )
    prefixes = (
        "RANK",
        "ACCELFN_",
        "WANDB_",
        "MLFLOW_",
        "COMET_",
        "CLEARML_",
        "TRAINS_",
        "SWANLAB_",
        "AIM_",
        "DVC",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    env.update(
        HOME=str(home),
        PYTHONPATH=str(ROOT),
        NETRC=str(home / "no-netrc"),
        COMET_ERROR_TRACKING_ENABLE="false",  # no Sentry client in comet_ml's import
        CLEARML_CONFIG_FILE=str(home / "clearml.conf"),
        CLEARML_CACHE_DIR=str(tmp_path / "clearml-cache"),
        DVC_NO_ANALYTICS="1",
        WANDB_SILENT="true",
        TRACKIO_DIR=str(tmp_path / "trackio"),
    )
    return env


def write(tmp_path, backend, attempts, *, options=None, timeout=180) -> dict:
    """Run the writer for ``backend`` in a fresh process in ``tmp_path`` (not a Git repository)."""
    run_dir = tmp_path / "run"
    spec = {"backend": backend, "run_dir": str(run_dir), "config": CONFIG, "attempts": attempts,
            "options": options or {}, "result": str(tmp_path / "result.json")}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", NETWORK_GUARD + WRITER, json.dumps(spec)],
        capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=offline_env(tmp_path),
    )  # fmt: skip
    out = f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, out
    assert "stdout still works" in proc.stdout, out
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["attempts"] == [], f"{backend} tried the network offline: {result['attempts']}\n{out}"
    assert not (tmp_path / ".dvc").exists() and not (ROOT / ".dvc").exists()
    return result


def needs(package: str) -> None:
    """Skip without ``package``; not imported here (comet_ml's import installs its auto-logging hooks)."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (pip install 'accelfn[trackers]')")


# ---- the five backends, read back with their own readers -----------------------------------------------------------
def comet_archive(path: pathlib.Path) -> tuple[dict, list[dict]]:
    """An offline Comet archive as its uploader reads it: experiment.json and the messages.json lines."""
    with zipfile.ZipFile(path) as z:
        experiment = json.loads(z.read("experiment.json"))
        messages = [
            json.loads(line) for line in z.read("messages.json").decode().splitlines() if line.strip()
        ]
    return experiment, messages


def test_comet_runs_offline_without_a_key_and_a_resumed_run_is_the_same_experiment(tmp_path):
    needs("comet_ml")
    result = write(tmp_path, "comet_ml", [[1, 6, None], [5, 8, 4]])
    first, second = (i["comet_ml"] for i in result["infos"])
    assert first["online"] == "False" and first["experiment_key"] == second["experiment_key"]
    archives = sorted(
        (comet_archive(p) for p in (tmp_path / "run" / "comet").glob("*.zip")),
        key=lambda a: a[0]["start_time"],
    )
    assert len(archives) == 2  # one offline archive per attempt, both for the same experiment key
    metrics: dict[tuple[str, int], float] = {}
    params = {}
    for experiment, messages in archives:  # in the order they were written
        assert experiment["offline_id"] == first["experiment_key"] and experiment["project_name"] == "accelfn"
        for m in messages:
            if m["type"] == "metric_msg":
                metric = m["payload"]["metric"]
                metrics[metric["metricName"], metric["step"]] = metric["metricValue"]
            elif m["type"] == "parameter_msg" and "param" in m["payload"]:
                params[m["payload"]["param"]["paramName"]] = m["payload"]["param"]["paramValue"]
    assert {s: metrics["loss", s] for s in range(1, 9)} == pytest.approx(losses(range(1, 9)))
    assert {s: metrics["eval/loss", s] for s in range(1, 9)} == pytest.approx({s: 2 / s for s in range(1, 9)})
    assert [metrics["attempt", s] for s in (4, 5, 6, 7)] == [1, 2, 2, 2]  # the resumed values come last
    assert metrics["nonfinite", 1] == "NaN"
    assert params["lr"] == 1e-3 and params["seed"] == 3


def aim_runs(repo: pathlib.Path) -> list:
    """The runs of an Aim repository as ``aim up`` shows them (runs are indexed by Aim's index manager)."""
    from aim import Repo
    from aim.sdk.index_manager import RepoIndexManager

    writer = Repo.from_path(str(repo))
    for run_hash in writer.list_all_runs():
        RepoIndexManager.get_index_manager(writer).index(run_hash)
    return list(Repo.from_path(str(repo), read_only=True).iter_runs())


def test_aim_writes_a_local_repository_and_a_resume_overwrites_the_steps_after_the_checkpoint(tmp_path):
    needs("aim")
    options = {"aim": {"system_tracking_interval": None, "capture_terminal_logs": False}}
    result = write(tmp_path, "aim", [[1, 6, None], [5, 8, 4]], options=options)
    first, second = (i["aim"] for i in result["infos"])
    assert first["run_hash"] == second["run_hash"]
    (run,) = aim_runs(tmp_path / "run")
    assert run.hash == first["run_hash"] and run.name == "run" and run.experiment == "accelfn"
    assert run["hparams"] == CONFIG
    frames = {seq.name: seq.dataframe() for seq in run.metrics()}
    loss = frames["loss"]
    assert list(loss["step"]) == list(range(1, 9))
    assert list(loss["value"]) == pytest.approx(list(losses(range(1, 9)).values()))
    assert list(frames["attempt"]["value"]) == [
        1,
        1,
        1,
        1,
        2,
        2,
        2,
        2,
    ]  # steps 5, 6 of the crashed attempt replaced
    assert list(frames["eval/loss"]["step"]) == list(range(1, 9))
    assert all(math.isnan(v) for v in frames["nonfinite"]["value"])


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pyparsing's, in ClearML's configuration parser
def test_clearml_runs_offline_without_a_server_and_its_session_reads_back(tmp_path):
    needs("clearml")
    from clearml.utilities.pyhocon import ConfigFactory

    result = write(
        tmp_path, "clearml", [[1, 6, None]], options={"clearml": {"auto_resource_monitoring": False}}
    )
    info = result["infos"][0]["clearml"]
    assert info["offline"] == "True"
    archive = tmp_path / "run" / "clearml" / f"{info['task_id']}.zip"
    with zipfile.ZipFile(archive) as z:  # the offline session, as Task.import_offline_session reads it
        task = json.loads(z.read("task.json"))
        events = [
            e
            for line in z.read("metrics.jsonl").decode().splitlines()
            if line.strip()
            for e in json.loads(line)
        ]
    assert task["project_name"] == "accelfn" and task["name"] == "run"
    config = ConfigFactory.parse_string(task["configuration"]["General"]["value"]).as_plain_ordered_dict()
    assert json.loads(json.dumps(config)) == CONFIG
    scalars = {
        (e["metric"], e["variant"], e["iter"]): e["value"]
        for e in events
        if e["type"] == "training_stats_scalar"
    }
    assert {s: scalars["loss", "train", s] for s in range(1, 7)} == pytest.approx(losses(range(1, 7)))
    # Accelerate's naming: eval_loss (here eval/loss) is the series "eval" of the plot "loss"
    assert {s: scalars["loss", "eval", s] for s in range(1, 7)} == pytest.approx(
        {s: 2 / s for s in range(1, 7)}
    )
    assert scalars["tokens", "train", 6] == 600
    assert (
        scalars["nonfinite", "train", 1] == 0.0
    )  # ClearML reports NaN as 0 (Logger.set_reporting_nan_value)


def test_dvclive_files_read_back_and_a_resume_drops_the_rows_after_the_checkpoint(tmp_path):
    needs("dvclive")
    from dvclive.serialize import load_yaml
    from dvclive.utils import parse_json, parse_tsv

    write(tmp_path, "dvclive", [[1, 6, None], [5, 8, 4]])
    live = tmp_path / "run" / "dvclive"
    loss = parse_tsv(live / "plots" / "metrics" / "loss.tsv")
    assert [int(r["step"]) for r in loss] == list(range(1, 9))  # no step twice
    assert [float(r["loss"]) for r in loss] == pytest.approx(list(losses(range(1, 9)).values()))
    attempt = parse_tsv(live / "plots" / "metrics" / "attempt.tsv")
    assert [int(r["attempt"]) for r in attempt] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert [int(r["step"]) for r in parse_tsv(live / "plots" / "metrics" / "eval" / "loss.tsv")] == list(
        range(1, 9)
    )
    assert all(
        math.isnan(float(r["nonfinite"])) for r in parse_tsv(live / "plots" / "metrics" / "nonfinite.tsv")
    )
    summary = parse_json(live / "metrics.json")
    assert (
        summary["step"] == 8 and summary["loss"] == pytest.approx(1 / 8) and summary["eval"]["loss"] == 0.25
    )
    assert load_yaml(live / "params.yaml") == CONFIG
    assert load_yaml(tmp_path / "run" / "dvc.yaml")["metrics"] == ["dvclive/metrics.json"]
    assert not (tmp_path / "dvc.yaml").exists()  # not in the working directory


def swanlab_backup(run_folder: pathlib.Path):
    """A SwanLab offline run as ``swanlab sync`` parses it (the reader of swanlab 0.6 and 0.7 backups)."""
    try:
        from swanlab.log.backup.datastore import DataStore
        from swanlab.log.backup.models import ModelsParser
    except ImportError:
        pytest.skip("this test reads the backup files of swanlab 0.6-0.7 (the version in constraints.txt)")
    store = DataStore()
    store.open_for_scan(str(run_folder / "backup.swanlab"))
    with ModelsParser() as parser:
        for record in store:
            if record is not None:
                parser.parse_record(record)
    return parser.get_parsed()


def test_swanlab_runs_offline_without_a_key_and_its_backup_reads_back(tmp_path):
    needs("swanlab")
    import yaml

    write(tmp_path, "swanlab", [[1, 6, None]])
    (folder,) = (tmp_path / "run" / "swanlog").glob("run-*")
    _, project, experiment, _, _, _, scalars, _, _ = swanlab_backup(folder)
    assert project.name == "accelfn" and experiment.name == "run"
    values = {(s.key, s.step): s.metric["data"] for s in scalars}
    assert {s: values["loss", s] for s in range(1, 7)} == pytest.approx(losses(range(1, 7)))
    assert {s: values["eval/loss", s] for s in range(1, 7)} == pytest.approx({s: 2 / s for s in range(1, 7)})
    assert values["nonfinite", 1] == "NaN"
    config = yaml.safe_load((folder / "files" / "config.yaml").read_text())
    assert {k: config[k]["value"] for k in CONFIG} == CONFIG


# ---- "all" -------------------------------------------------------------------------------------------------------------
@pytest.fixture
def clean_env(monkeypatch):
    for name in ("RANK", "ACCELFN_LOG_WITH"):
        monkeypatch.delenv(name, raising=False)


def test_all_is_every_tracker_accelerate_finds_plus_jsonl(clean_env):
    accelerate_tracking = pytest.importorskip("accelerate.tracking")
    names = trackers.parse_log_with("all")
    assert names[0] == "jsonl" and len(names) == len(set(names))
    # Accelerate's log_with="all": get_available_trackers() (tensorboard also counts with tensorboardX only)
    theirs = {str(t) for t in accelerate_tracking.get_available_trackers()}
    if importlib.util.find_spec("tensorboard") is None:
        theirs.discard("tensorboard")
    assert set(names) - {"jsonl"} == theirs
    assert set(names) <= set(trackers.BACKENDS)
    assert trackers.parse_log_with("ALL, jsonl") == names == trackers.parse_log_with(["all"])


def test_all_leaves_out_what_is_not_installed_and_keeps_tracker_objects(clean_env, monkeypatch, tmp_path):
    class Mine:
        name = "mine"

        def __init__(self):
            self.lines = []

        def log(self, metrics, step):
            self.lines.append(step)

        def log_config(self, config):
            pass

        def close(self):
            pass

    for package in ("tensorboard", "wandb", "mlflow", "trackio", *NEW):
        monkeypatch.setitem(sys.modules, package, None)  # as if not installed
    mine = Mine()
    assert trackers.parse_log_with([mine, "all"]) == [mine, "jsonl"]
    with trackers.open(tmp_path, [mine, "all"], log_every=1) as run:
        run.log({"loss": 0.5}, step=1)
        assert [t.name for t in run.trackers] == ["mine", "jsonl"]
    assert mine.lines == [1]
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["loss"] == 0.5
    # named explicitly, a missing tracker is still an error
    with pytest.raises(TrackerError, match=r"tracker 'aim': not installed .*pip install 'accelfn\[aim\]'"):
        trackers.open(tmp_path, "all,aim")


def test_all_leaves_out_aim_4_as_accelerate_does(clean_env, monkeypatch):
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setitem(sys.modules, "aim", sys.modules.get("aim") or object())
    monkeypatch.setattr(importlib.metadata, "version", lambda p: "4.0.1" if p == "aim" else real(p))
    assert "aim" not in trackers.parse_log_with("all")


def test_all_goes_through_the_launcher_the_config_file_and_the_variable(clean_env, monkeypatch, tmp_path):
    plan = resolve(LaunchOptions(script="t.py", cpu=True, log_with="All"), environ={})
    assert plan.env["ACCELFN_LOG_WITH"] == "all"  # resolved in the worker, where the packages are
    assert load(save(Config(log_with="all"), tmp_path / "c.yaml")).log_with == "all"
    assert launch_env.read_env({"ACCELFN_LOG_WITH": "all"}).log_with == ("all",)
    monkeypatch.setenv("ACCELFN_LOG_WITH", "all")
    assert trackers.parse_log_with("auto") == trackers.parse_log_with("all")
    with pytest.raises(ValueError, match="'none' cannot be combined"):
        launch_env.parse_log_with("all,none")
    (tmp_path / "bad.yaml").write_text("log_with: [alll]\n")
    with pytest.raises(ConfigError, match="unknown tracker 'alll'; known: .*swanlab, all, none"):
        load(tmp_path / "bad.yaml")


def test_the_new_backends_are_registered_like_the_others():
    assert tuple(trackers.BACKENDS)[-5:] == NEW and tuple(trackers.BACKENDS) == launch_env.TRACKERS
    for name in NEW:
        module, cls_name, package = trackers.BACKENDS[name]
        assert getattr(trackers, cls_name).name == name and package == name


@pytest.mark.parametrize("backend", NEW)
def test_a_missing_new_package_names_its_extra(tmp_path, monkeypatch, backend):
    module, cls_name, package = trackers.BACKENDS[backend]
    cls = getattr(trackers, cls_name)
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(TrackerError, match=rf"tracker '{backend}': .*pip install 'accelfn\[{backend}\]'"):
        cls(tmp_path)


@pytest.mark.slow
def test_all_opens_every_installed_tracker_offline_and_each_gets_the_run(tmp_path):
    names = trackers.parse_log_with("all")
    if len(names) < 2:
        pytest.skip("no tracker package installed")
    options = {
        "aim": {"system_tracking_interval": None, "capture_terminal_logs": False},
        "clearml": {"auto_resource_monitoring": False},
    }
    result = write(tmp_path, "all", [[1, 4, None]], options={k: v for k, v in options.items() if k in names},
                   timeout=300)  # fmt: skip
    assert list(result["infos"][0]) == names
    run = tmp_path / "run"
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    written = {  # what each backend leaves in the run folder
        "tensorboard": "tensorboard", "wandb": "wandb_run_id", "mlflow": "mlflow.db", "comet_ml": "comet",
        "aim": ".aim", "clearml": "clearml", "dvclive": "dvclive/metrics.json", "swanlab": "swanlog",
    }  # fmt: skip
    for name in names:
        if name in written:
            assert (run / written[name]).exists(), (name, sorted(p.name for p in run.iterdir()))


UNWRITABLE = r"""
import json, sys
from accelfn import trackers

spec = json.loads(sys.argv[1])
errors = {}
for backend in spec["backends"]:
    try:
        trackers.open(spec["run_dir"], backend).close()
        errors[backend] = None
    except trackers.TrackerError as e:
        errors[backend] = [e.backend, str(e)]
    except Exception as e:  # noqa: BLE001 - reported: the wrapper should have turned it into a TrackerError
        errors[backend] = ["?", f"{type(e).__name__}: {e}"]
with open(spec["result"], "w") as f:
    json.dump({"errors": errors, "attempts": ATTEMPTS}, f)
"""

WRITING = (
    "jsonl",
    "tensorboard",
    "wandb",
    *NEW,
)  # the backends whose files go through trackers.base.writing()


def test_every_backend_names_itself_and_the_folder_it_cannot_write(tmp_path):
    """An unwritable run folder (under a file) for each backend that writes files, in one fresh process with the
    network blocked: one TrackerError naming the backend and the folder, from `writing()` around each
    backend's own file operations."""
    (tmp_path / "file").write_text("not a folder")
    run_dir = tmp_path / "file" / "run"
    spec = {"backends": WRITING, "run_dir": str(run_dir), "result": str(tmp_path / "result.json")}
    proc = subprocess.run(
        [sys.executable, "-c", NETWORK_GUARD + UNWRITABLE, json.dumps(spec)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path, env=offline_env(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["attempts"] == []
    for backend, error in result["errors"].items():
        assert error is not None, f"{backend} opened a run under a file"
        named, message = error
        assert named == backend and message.startswith(f"tracker '{backend}': cannot write "), error
        assert str(tmp_path / "file") in message, error


def test_trackers_close_last_opened_first(tmp_path):
    # Comet, Aim and SwanLab each wrap sys.stdout and put back what they found: closing in opening order
    # left the process printing into a closed wrapper (all output lost with log_with="all")
    closed = []

    class Wrapper:
        def __init__(self, name):
            self.name = name

        def log(self, metrics, step):
            pass

        def log_config(self, config):
            pass

        def close(self):
            closed.append(self.name)

    with trackers.open(tmp_path, [Wrapper("first"), "jsonl", Wrapper("second")]):
        pass
    assert closed == ["second", "first"]


# ---- NaN and infinities in JSONL ---------------------------------------------------------------------------------------
def test_jsonl_writes_nan_and_infinities_as_json_number_tokens_that_readers_load_as_floats(tmp_path):
    with trackers.open(tmp_path, log_every=2) as run:
        run.log({"loss": torch.tensor(float("nan")), "grad_norm": float("inf"), "lr": 0.1}, step=1)
        run.log({"loss": torch.tensor(0.5), "grad_norm": -math.inf, "lr": 0.1}, step=2)
        run.log({"loss": torch.tensor(0.25), "grad_norm": 1.0, "lr": 0.1}, step=3)
    text = (tmp_path / "metrics.jsonl").read_text()
    assert '"loss": NaN' in text and '"grad_norm": Infinity' in text and '"grad_norm": -Infinity' in text
    assert '"nan"' not in text and '"inf"' not in text
    lines = [json.loads(line) for line in text.splitlines()]
    assert (
        math.isnan(lines[0]["loss"])
        and lines[0]["grad_norm"] == math.inf
        and lines[1]["grad_norm"] == -math.inf
    )
    assert all(isinstance(ln["grad_norm"], float) for ln in lines)
    # accelfn plot's reader: floats (non-finite points are left out of the curves)
    records = read_metrics(tmp_path)
    assert math.isnan(records[0]["loss"]) and records[1]["grad_norm"] == -math.inf
    # resume keeps the lines with NaN (they parse)
    with trackers.open(tmp_path, resume_step=2) as run:
        run.log({"loss": 0.125}, step=3)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3] and math.isnan(
        read_metrics(tmp_path)[0]["loss"]
    )


def test_jsonl_nan_reads_back_with_pandas_and_jq(tmp_path):
    with trackers.open(tmp_path, log_every=1) as run:
        run.log({"loss": float("nan"), "grad_norm": float("inf")}, step=1)
        run.log({"loss": 0.5, "grad_norm": 2.0}, step=2)
    pd = pytest.importorskip("pandas")
    frame = pd.read_json(tmp_path / "metrics.jsonl", lines=True)
    assert frame["loss"].dtype == float and math.isnan(frame["loss"][0]) and frame["loss"][1] == 0.5
    assert frame["grad_norm"][0] == math.inf
    if shutil.which("jq") is None:
        pytest.skip("jq is not installed")
    out = subprocess.run(["jq", "-c", "[.step, .loss, .grad_norm > 1e308]", str(tmp_path / "metrics.jsonl")],
                         capture_output=True, text=True, timeout=30, check=True).stdout  # fmt: skip
    assert out.splitlines() == [
        "[1,null,true]",
        "[2,0.5,false]",
    ]  # jq: NaN is null, Infinity the largest double
