"""`accelfn estimate-memory` on a config: the class `architectures` names (as Accelerate counts it), one line
on what it cannot build, and none of the libraries' chatter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from accelfn.cli.main import main

TINY_BERT = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
TINY_GPT2 = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 1000}


def _write(tmp_path, fields: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return str(path)


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "accelfn.cli.main", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)  # fmt: skip


def _row(out: str, dtype: str) -> list[str]:
    line = next(r for r in out.splitlines() if r.startswith(f"| {dtype} |"))
    return [c.strip() for c in line.split("|")[2:5]]


def test_the_architectures_class_is_estimated_as_accelerate_counts_it(tmp_path, capsys):
    from accelerate import init_empty_weights
    from accelerate.utils import calculate_maximum_sizes
    from transformers import BertConfig, BertForSequenceClassification

    import accelfn as af

    path = _write(
        tmp_path, {"model_type": "bert", "architectures": ["BertForSequenceClassification"], **TINY_BERT}
    )
    assert main(["estimate-memory", path, "--dtypes", "float32"]) == 0
    out = capsys.readouterr().out
    with init_empty_weights():
        model = BertForSequenceClassification(BertConfig(**TINY_BERT))
    total, (largest, _names) = calculate_maximum_sizes(model)  # what `accelerate estimate-memory` reports
    assert out.startswith(f"{path}: BertForSequenceClassification, ")
    assert _row(out, "float32")[:2] == [af.big.format_size(total), af.big.format_size(largest)]


@pytest.mark.parametrize("architectures", [["GPT2LMHeadModel"], "GPT2LMHeadModel"], ids=["list", "one name"])
def test_without_model_type_the_architectures_class_gives_it(tmp_path, capsys, architectures):
    from transformers import GPT2Config, GPT2LMHeadModel

    path = _write(tmp_path, {"architectures": architectures, **TINY_GPT2})
    assert main(["estimate-memory", path, "--dtypes", "float32"]) == 0
    captured = capsys.readouterr()
    n = sum(p.numel() for p in GPT2LMHeadModel(GPT2Config(**TINY_GPT2)).parameters())
    assert f"GPT2LMHeadModel, {n / 1e6:,.2f}M parameters" in captured.out
    assert "no 'model_type': 'gpt2', the type of GPT2LMHeadModel" in captured.err


def test_an_architecture_transformers_lacks_is_named_with_what_was_estimated(tmp_path, capsys):
    # remote code (auto_map) is not run: the causal LM of the type instead, said in one line
    fields = {"model_type": "gpt2", "architectures": ["MyGPT2ForMagic"], **TINY_GPT2,
              "auto_map": {"AutoModelForCausalLM": "modeling.MyGPT2ForMagic"}}  # fmt: skip
    assert main(["estimate-memory", _write(tmp_path, fields), "--dtypes", "float32"]) == 0
    captured = capsys.readouterr()
    assert ": GPT2LMHeadModel, " in captured.out
    assert captured.err.strip().splitlines() == [
        "accelfn estimate-memory: note: architectures MyGPT2ForMagic: not a transformers 'gpt2' model class "
        "(remote code is not run); estimated GPT2LMHeadModel instead"
    ]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model_type": "mistery_model", "architectures": ["MisteryForCausalLM"]},
         "model_type 'mistery_model' is not one transformers"),
        ({"architectures": ["MisteryForCausalLM"]}, "has no 'model_type' nor an 'architectures' transformers"),
        ({"model_type": "llama", "hidden_size": "big"}, "not a valid 'llama' config ("),
        ({"model_type": "bert", **TINY_BERT, "hidden_size": 30, "num_attention_heads": 4},
         "is not a multiple of the number of attention heads"),
        ([1, 2], "is not a transformers config.json (a JSON object)"),
    ],
    ids=["unknown type", "unknown architecture", "bad value", "inconsistent values", "not an object"],
)  # fmt: skip
def test_a_config_it_cannot_build_is_one_line_and_exit_2(tmp_path, fields, message):
    path = _write(tmp_path, fields)
    proc = _cli("estimate-memory", path)
    assert proc.returncode == 2, proc.stderr
    ours = [line for line in proc.stderr.splitlines() if line.startswith("accelfn estimate-memory: ")]
    assert len(ours) == 1 and path in ours[0] and message in ours[0], proc.stderr
    assert "Traceback" not in proc.stderr and len(ours[0]) < 300, proc.stderr
    assert proc.stdout == ""


def test_building_the_model_prints_none_of_the_libraries_chatter(tmp_path):
    # a bert config without architectures: transformers advises on BertLMHeadModel, optional backends warn
    proc = _cli(
        "estimate-memory", _write(tmp_path, {"model_type": "bert", **TINY_BERT}), "--dtypes", "float32"
    )
    assert proc.returncode == 0, proc.stderr
    assert "BertLMHeadModel" in proc.stdout and "| float32 |" in proc.stdout
    for chatter in ("[transformers]", "is_decoder", "Failed to load", "_pytree.py", "Traceback"):
        assert chatter not in proc.stderr, proc.stderr


def _hub_env(tmp_path) -> dict[str, str]:
    import os

    return {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}


def _cached_gpt2(tmp_path, repo: str, commit: str):
    """A tiny GPT-2 config.json in a Hugging Face cache under `tmp_path / "hub"`, laid out as `hf download`
    leaves it (`repo`: `models--ORG--NAME` or `models--NAME`); its path."""
    (tmp_path / "hub" / repo / "refs").mkdir(parents=True)
    (tmp_path / "hub" / repo / "refs" / "main").write_text(commit)
    snapshot = tmp_path / "hub" / repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], **TINY_GPT2}
    (snapshot / "config.json").write_text(json.dumps(config))
    return snapshot / "config.json"


def test_a_hub_id_reads_its_config_from_the_hugging_face_cache(tmp_path):
    """`org/name` (not a path here) is a Hub id: its config.json alone, from the cache huggingface_hub keeps
    (laid out as `hf download` leaves it), estimated as the same file passed by path."""
    config = _cached_gpt2(tmp_path, "models--tiny-org--tiny-gpt2", "0" * 40)
    env = _hub_env(tmp_path)
    by_id = subprocess.run([sys.executable, "-m", "accelfn.cli.main", "estimate-memory", "tiny-org/tiny-gpt2"],
                           capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)  # fmt: skip
    assert by_id.returncode == 0, by_id.stderr
    by_path = _cli("estimate-memory", str(config))
    assert by_id.stdout.startswith("tiny-org/tiny-gpt2: GPT2LMHeadModel, ")
    assert by_id.stdout.splitlines()[1:] == by_path.stdout.splitlines()[1:]


def test_a_hub_id_without_an_org_reads_its_config_from_the_cache_unless_a_path_has_its_name(tmp_path):
    """`tiny-gpt2` (no org, as `gpt2` or `bert-base-uncased`) is a Hub id where no path of that name exists here,
    as Accelerate reads it: its config.json from the cache (`models--tiny-gpt2`); a folder of that name in the
    current folder is read as the folder; not cached, offline, it says how to fetch it."""
    config = _cached_gpt2(tmp_path, "models--tiny-gpt2", "1" * 40)
    env = _hub_env(tmp_path)
    work = tmp_path / "work"
    work.mkdir()

    def run(spec: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "accelfn.cli.main", "estimate-memory", spec],
                              capture_output=True, text=True, timeout=120, env=env, cwd=work)  # fmt: skip

    by_id = run("tiny-gpt2")
    assert by_id.returncode == 0, by_id.stderr
    by_path = _cli("estimate-memory", str(config))
    assert by_id.stdout.startswith("tiny-gpt2: GPT2LMHeadModel, ")
    assert by_id.stdout.splitlines()[1:] == by_path.stdout.splitlines()[1:]

    (work / "tiny-gpt2").mkdir()  # a local folder of that name: read as the folder, not the Hub id
    (work / "tiny-gpt2" / "config.json").write_text(json.dumps({"model_type": "bert", **TINY_BERT}))
    local = run("tiny-gpt2")
    assert local.returncode == 0, local.stderr
    assert local.stdout.startswith("tiny-gpt2: Bert"), local.stdout

    missing = run("no-such-model")  # (as well a mistyped folder: the message says both)
    assert missing.returncode == 2
    assert (
        "no file or folder named 'no-such-model' here; as a Hub id: 'no-such-model' looks like"
        in missing.stderr
    )
    assert "hf download no-such-model config.json" in missing.stderr
    assert "Traceback" not in missing.stderr
    colon = run("json.decoder")  # a factory missing its colon: named as one
    assert colon.returncode == 2
    assert "a factory is written 'pkg.module:function' ('json' is an importable module)" in colon.stderr


def test_a_hub_id_not_in_the_cache_offline_says_how_to_get_its_config(tmp_path):
    env = _hub_env(tmp_path)
    r = subprocess.run([sys.executable, "-m", "accelfn.cli.main", "estimate-memory", "no-org/no-model"],
                       capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 2
    assert "'no-org/no-model' looks like a Hub id" in r.stderr
    assert "hf download no-org/no-model config.json" in r.stderr
    assert "Traceback" not in r.stderr


def test_neither_a_path_a_hub_id_nor_a_factory_is_named(capsys):
    assert main(["estimate-memory", "no/such/folder"]) == 2
    err = capsys.readouterr().err
    assert (
        "'no/such/folder' is not a file or folder here, a Hub id ('org/name' or 'name'), or a factory" in err
    )
    assert main(["estimate-memory", "models/config.json"]) == 2  # a missing file, not a Hub id
    assert "models/config.json: no such file" in capsys.readouterr().err
