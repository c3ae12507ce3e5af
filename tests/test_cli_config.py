"""`accelfn config` / `accelfn env` and the YAML config: round trip, and errors that name the culprit."""

from __future__ import annotations

import pytest

from accelfn.cli.config import ask
from accelfn.cli.main import main
from accelfn.launch.config import Config, ConfigError, Fp8Config, default_config_path, load, save


def test_default_config_round_trips_through_the_cli(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    assert main(["config", "--default", "--config-file", str(path)]) == 0
    assert str(path) in capsys.readouterr().out
    assert load(path) == Config()


def test_config_default_keeps_an_existing_file_unless_forced(tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    save(Config(num_processes=4), path)
    assert main(["config", "--default", "--config-file", str(path)]) == 2
    assert (
        f"{path} exists; not replaced by the defaults (--force or -y replaces it)" in capsys.readouterr().err
    )
    assert load(path) == Config(num_processes=4)
    assert main(["config", "--default", "--force", "--config-file", str(path)]) == 0
    assert f"replaced {path}" in capsys.readouterr().out
    assert load(path) == Config()


def test_config_refuses_a_folder_and_writes_nothing_when_input_ends(tmp_path, capsys, monkeypatch):
    assert main(["config", "--default", "--config-file", str(tmp_path)]) == 2
    assert f"{tmp_path} is a folder; --config-file takes a file path" in capsys.readouterr().err
    path = tmp_path / "cfg.yaml"
    answers = iter(["cpu", "2"])

    def input_then_eof(prompt):  # Ctrl-D on the third question (or stdin not a terminal)
        try:
            return next(answers)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr("builtins.input", input_then_eof)
    assert main(["config", "--config-file", str(path)]) == 1
    assert "end of input; nothing written" in capsys.readouterr().err
    assert not path.exists()

    def interrupted(prompt):
        raise KeyboardInterrupt

    monkeypatch.setattr("builtins.input", interrupted)
    assert main(["config", "--config-file", str(path)]) == 1
    assert "interrupted; nothing written" in capsys.readouterr().err and not path.exists()


class _Terminal:
    """stdin as a terminal, for the questions `accelfn config` asks only there."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("answer", "code", "replaced"), [("y", 0, True), ("yes", 0, True), ("n", 1, False),
                                                          ("", 1, False), (EOFError, 1, False)])  # fmt: skip
def test_config_default_asks_on_a_terminal_before_replacing(
    tmp_path, capsys, monkeypatch, answer, code, replaced
):
    path = save(Config(num_processes=4), tmp_path / "cfg.yaml")
    asked = []

    def reply(prompt):
        asked.append(prompt)
        if answer is EOFError:  # Ctrl-D at the prompt: no, and no traceback
            raise EOFError
        return answer

    monkeypatch.setattr("sys.stdin", _Terminal())
    monkeypatch.setattr("builtins.input", reply)
    assert main(["config", "--default", "--config-file", str(path)]) == code
    assert asked == [f"{path} exists. Replace it with the defaults? [y/N]: "]
    assert load(path) == (Config() if replaced else Config(num_processes=4))
    assert (f"kept {path}" in capsys.readouterr().err) != replaced
    asked.clear()
    save(Config(num_processes=4), path)
    assert main(["config", "--default", "-y", "--config-file", str(path)]) == 0  # -y: no question
    assert asked == [] and load(path) == Config()


def test_config_file_named_as_a_folder_is_refused_and_nothing_is_created(tmp_path, capsys):
    where = f"{tmp_path / 'newdir'}/"  # does not exist yet, but the trailing slash says folder
    assert main(["config", "--default", "--config-file", where]) == 2
    assert f"{where} is a folder; --config-file takes a file path" in capsys.readouterr().err
    assert not (tmp_path / "newdir").exists()


def test_config_as_a_command_ends_cleanly_without_input_or_on_a_folder(tmp_path):
    import subprocess
    import sys

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "accelfn.cli.main", "config", *args],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)  # fmt: skip

    path = tmp_path / "c.yaml"
    proc = cli("--config-file", str(path))  # stdin at end of input at once: the first question gets EOF
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "accelfn config: end of input; nothing written" in proc.stderr and not path.exists()
    proc = cli("--config-file", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"accelfn config: {tmp_path} is a folder" in proc.stderr
    save(Config(num_processes=4), path)
    proc = cli("--default", "--config-file", str(path))  # no terminal to ask on: refused, file kept
    assert proc.returncode == 2 and "not replaced by the defaults (--force or -y replaces it)" in proc.stderr
    assert load(path) == Config(num_processes=4)


def test_every_field_round_trips(tmp_path):
    cfg = Config(
        num_processes=4,
        num_machines="1:3",
        machine_rank=1,
        rdzv_endpoint="h:29500",
        rdzv_backend="static",
        rdzv_id="job7",
        mixed_precision="fp8",
        mesh={"dp": -1, "tp": 2},
        device="cuda",
        max_restarts=2,
        monitor_interval=1,
        fp8={"backend": "torchao", "recipe": "rowwise"},
        log_with=["tensorboard", "jsonl"],
    )
    assert cfg.log_with == "tensorboard,jsonl"
    assert cfg.mesh == "dp=-1,tp=2" and cfg.fp8 == Fp8Config("torchao", "rowwise")
    assert load(save(cfg, tmp_path / "c.yaml")) == cfg


def test_default_location_is_the_user_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_config_path() == tmp_path / "accelfn" / "default_config.yaml"
    assert main(["config", "--default"]) == 0
    assert (tmp_path / "accelfn" / "default_config.yaml").is_file()


def test_unknown_key_is_an_error_naming_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_processes: 2\nmixed_precison: bf16\n")
    with pytest.raises(
        ConfigError, match="unknown config key 'mixed_precison'; known keys: .*mixed_precision"
    ):
        load(path)


def test_unknown_nested_key_is_an_error_naming_it(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("fp8: {backend: te, scaling: delayed}\n")
    with pytest.raises(ConfigError, match="'fp8.scaling'"):
        load(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("mixed_precision: bf8\n", "'mixed_precision': 'bf8' is not one of no, bf16, fp16, fp8"),
        ("device: tpu\n", "'device': 'tpu' is not one of auto, cpu, cuda, xla, xpu, npu, mlu"),
        ("rdzv_backend: etcd\n", "'rdzv_backend': 'etcd' is not one of c10d, static"),
        ("num_processes: many\n", "'num_processes': 'many' must be an integer >= 1 or one of auto"),
        ("num_machines: 3:1\n", "num_machines"),
        ("mesh: dp=2,tp=x\n", "config key 'mesh'"),
        ("fp8: {backend: cuda}\n", "'fp8.backend': 'cuda' is not one of auto, torchao, te"),
        ("mesh: 2\n", "config key 'mesh': expected a string like 'dp=2,tp=4', got 2"),
    ],
)
def test_bad_value_names_the_key_and_the_allowed_values(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_yaml_spellings_of_defaults_are_read_as_meant(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("mixed_precision: no\nrdzv_id:\n")  # YAML 1.1 reads `no` as false, an empty value as null
    cfg = load(path)
    assert (cfg.mixed_precision, cfg.rdzv_id) == ("no", "")


def test_node_range_is_not_read_as_a_base_60_number(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_machines: 1:4\nnum_processes: 8\n")
    assert (load(path).num_machines, load(path).num_processes) == ("1:4", 8)


def test_yaml_is_read_safely(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("!!python/object/apply:os.system ['echo hacked']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load(path)


def test_bad_config_makes_launch_exit_2_with_the_key(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("max_restarts: -1\n")
    assert main(["launch", "--config-file", str(path), "--cpu", "x.py"]) == 2
    assert "'max_restarts': -1 must be an integer >= 0" in capsys.readouterr().err


def test_questionnaire_asks_again_after_a_bad_answer():
    answers = iter(["cpu", "2", "", "", "", "", "fp32", "bf16", "dp=2", "1", "tb", "tensorboard,jsonl"])
    said: list[str] = []
    cfg = ask(input_fn=lambda _q: next(answers), print_fn=said.append)
    assert cfg == Config(device="cpu", num_processes=2, mixed_precision="bf16", mesh="dp=2", max_restarts=1,
                         log_with="tensorboard,jsonl")  # fmt: skip
    assert any("'fp32' is not one of no, bf16, fp16, fp8" in s for s in said)
    assert any("unknown tracker 'tb'" in s for s in said)


def test_env_prints_versions_platform_and_config(tmp_path, capsys):
    path = save(Config(num_processes=2), tmp_path / "c.yaml")
    assert main(["env", "--config-file", str(path)]) == 0
    out = capsys.readouterr().out
    for key in (
        "- accelfn:",
        "- python:",
        "- torch:",
        "- deepspeed:",
        "- torchao:",
        "- transformers:",
        "- optree:",
        "- safetensors:",
        "- peft:",
        "- platform:",
        "- devices:",
        "- config:",
    ):
        assert key in out
    assert "'num_processes': 2" in out
    import importlib.metadata

    assert f"- peft: {importlib.metadata.version('peft')}" in out  # the installed version, read not guessed
    for name in ("accelerate", "huggingface_hub", "matplotlib", "rich"):  # what else accelfn uses if there
        assert f"- {name}: {importlib.metadata.version(name.replace('_', '-'))}" in out


def test_env_lists_every_tracker_backend_with_its_version(capsys, monkeypatch):
    import importlib.metadata
    import importlib.util

    from accelfn.trackers import BACKENDS

    real = importlib.util.find_spec
    monkeypatch.setattr(
        "importlib.util.find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    assert main(["env"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("- trackers: "))
    installed, _, missing = line.partition("; not installed: ")
    assert "jsonl (built in)" in installed and "wandb" in missing.split(", ") and "wandb" not in installed
    for name in BACKENDS:
        assert name in line
    assert f"tensorboard {importlib.metadata.version('tensorboard')}" in line


def test_env_reports_an_unusable_device_setting_instead_of_crashing(monkeypatch, capsys):
    monkeypatch.setenv("ACCELFN_DEVICE", "bogus")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "- platform: none (" in out and "bogus" in out and "- config:" in out


def test_estimate_memory_bad_inputs_exit_2_naming_them(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text("not json")
    assert main(["estimate-memory", str(bad)]) == 2
    assert f"{bad} is not a JSON config" in capsys.readouterr().err
    assert main(["estimate-memory", "no_such_module_xyz:build"]) == 2
    assert "cannot find the factory 'no_such_module_xyz:build'" in capsys.readouterr().err
    assert main(["estimate-memory", "math:pi"]) == 2  # a float, not a factory
    assert "math:pi" in capsys.readouterr().err
    bad.write_text(
        '{"model_type": "lamma"}'
    )  # a typo: one line naming it and the closest, not 11 KB of types
    assert main(["estimate-memory", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "model_type 'lamma' is not one transformers" in err and "did you mean 'llama'" in err
    assert len(err) < 300, err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["estimate-memory", str(empty)]) == 2
    assert f"{empty} has no config.json" in capsys.readouterr().err
