"""Expert-parallel checkpoints: resharded between ep layouts (real processes), and Hugging Face's per-expert
layout written by `save_pretrained` and read by `load_pretrained`."""

import pytest
import torch

from tests._launch import output_of, run_workers


@pytest.mark.slow
def test_an_ep2_checkpoint_loads_at_ep4_and_at_fsdp2_x_ep2(tmp_path):
    """Params and AdamW state exact after the reshard; one more step equal to the saved layout's."""
    proc = run_workers("ep_ckpt_worker.py", 4, str(tmp_path / "ckpt"), timeout=300)
    assert proc.returncode == 0, output_of(proc)
    for layout in ("ep4", "fsdp2xep2"):
        assert proc.stdout.count(f"OK {layout}") == 4, output_of(proc)
    # the ep2-trained model's save_pretrained folder: transformers loads it with no missing or unexpected key
    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM

    model, info = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "ckpt-hf", output_loading_info=True)
    assert not any(info.values()), info
    want = load_file(tmp_path / "ckpt-full.safetensors")
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
