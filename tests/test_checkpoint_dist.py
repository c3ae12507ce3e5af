"""Checkpoints of FSDP2-sharded states on 2 processes, loaded on 1, and the reverse."""

import pytest
import torch
from _launch import output_of, run_workers

import accelfn as af
from tests.workers.ckpt_fsdp import expected_params, fill, make_state


@pytest.mark.slow
def test_fsdp2_checkpoints_reshard_between_two_ranks_and_one(tmp_path):
    ref = expected_params(0)
    af.checkpoint.save(tmp_path / "from1", fill(make_state({k: v.clone() for k, v in ref.items()}), ref))

    proc = run_workers("ckpt_fsdp.py", 2, str(tmp_path), timeout=240)
    assert proc.returncode == 0, output_of(proc)
    assert "rank 0 ok" in proc.stdout and "rank 1 ok" in proc.stdout, output_of(proc)

    assert (tmp_path / "from2" / "model-rank00001.safetensors").exists() or any(
        p.name.startswith("model-rank00001") for p in (tmp_path / "from2").iterdir()
    )
    for name in ["from2", "from2-async"]:
        like = make_state({k: torch.zeros_like(v) for k, v in ref.items()})
        loaded = af.checkpoint.load(tmp_path / name, like=like)
        for k, v in ref.items():
            assert torch.equal(loaded.params[k], v), k
            assert torch.equal(loaded.opt_state[1].mu[k], 2 * v) and torch.equal(
                loaded.opt_state[1].nu[k], v * v
            ), k
        assert int(loaded.step) == 7 and loaded.extra["note"] == "fsdp"

    from transformers import AutoModelForCausalLM

    for name in ["hf2", "hf2-module"]:
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        got = dict(hf.named_parameters())
        for k, v in ref.items():
            assert torch.equal(got[k], v), (name, k)
        assert hf.lm_head.weight is hf.transformer.wte.weight
