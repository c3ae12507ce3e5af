"""Expert-parallel checkpoints: resharded between ep layouts (real processes), and Hugging Face's per-expert
layout written by `save_pretrained` and read by `load_pretrained`."""

import pytest
import torch

import accelfn as af
from tests._launch import output_of, run_workers


@pytest.mark.slow
def test_an_ep2_checkpoint_loads_at_ep4_and_at_fsdp2_x_ep2_and_in_one_process(tmp_path):
    """Params and AdamW state exact after the reshard; one more step equal to the saved layout's. The same
    checkpoint loads in this process without ep: params and AdamW state exact."""
    from safetensors.torch import load_file

    from accelfn.tree import flatten_with_path
    from tests.workers.ep_worker import lm_loss, make_model

    proc = run_workers("ep_ckpt_worker.py", 4, str(tmp_path / "ckpt"), timeout=300)
    assert proc.returncode == 0, output_of(proc)
    for layout in ("ep4", "fsdp2xep2"):
        assert proc.stdout.count(f"OK {layout}") == 4, output_of(proc)
    fresh = af.train_step(lm_loss, af.optim.adamw(1e-2)).init(make_model("qwen", None), seed=5)
    loaded = af.checkpoint.load(tmp_path / "ckpt", like=fresh)
    got = {f"params/{k}": v for k, v in loaded.params.items()}
    got.update({f"opt/{k}": v for k, v in flatten_with_path(loaded.opt_state) if isinstance(v, torch.Tensor)})
    want = load_file(tmp_path / "ckpt-state.safetensors")
    assert sorted(got) == sorted(want) and any(k.startswith("opt/") and "experts" in k for k in want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
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


def _qwen_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
                         tie_word_embeddings=False)  # fmt: skip
    return Qwen3MoeForCausalLM(cfg)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=32)  # fmt: skip
    return MixtralForCausalLM(cfg)


def _olmoe():
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(0)
    cfg = OlmoeConfig(vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                      max_position_embeddings=32, pad_token_id=0, eos_token_id=1)  # fmt: skip
    return OlmoeForCausalLM(cfg)


MOES = {"qwen3_moe": _qwen_moe, "mixtral": _mixtral, "olmoe": _olmoe}
A_PER_EXPERT_KEY = {  # a key transformers' own save_pretrained writes for each
    "qwen3_moe": "model.layers.1.mlp.experts.3.up_proj.weight",
    "mixtral": "model.layers.1.block_sparse_moe.experts.3.w3.weight",  # w1 gate, w3 up, w2 down
    "olmoe": "model.layers.1.mlp.experts.3.up_proj.weight",
}


@pytest.mark.parametrize("kind", list(MOES))
def test_save_pretrained_writes_the_per_expert_keys_transformers_own_save_writes(tmp_path, kind):
    from safetensors.torch import load_file

    model = MOES[kind]()
    model.save_pretrained(tmp_path / "theirs")
    af.checkpoint.save_pretrained(tmp_path / "ours", model)
    theirs = load_file(tmp_path / "theirs" / "model.safetensors")
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    assert A_PER_EXPERT_KEY[kind] in ours
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in ours)
    assert sorted(ours) == sorted(theirs)
    for k, v in theirs.items():
        assert torch.equal(ours[k], v), k
    back, info = type(model).from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not any(info.values()), info
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k


@pytest.mark.parametrize("kind", list(MOES))
def test_load_pretrained_joins_per_expert_keys_into_fused_experts(tmp_path, kind):
    model = MOES[kind]()
    model.save_pretrained(tmp_path / "theirs", max_shard_size="10KB")  # transformers' own folder, in shards
    assert len(list((tmp_path / "theirs").glob("model-*.safetensors"))) > 2
    like = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    loaded = af.checkpoint.load_pretrained(tmp_path / "theirs", like=like)
    assert sorted(loaded) == sorted(model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(loaded[k], v), k


def test_load_pretrained_reads_only_this_ep_ranks_experts_of_a_mixtral_folder(tmp_path):
    """Rank 1 of ep=2 (torch's fake process group: no peer is needed to read) fills its Shard(0) pieces,
    experts 2 and 3, from transformers' own Mixtral folder and opens no other expert's key."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tests.workers.ep_ckpt_worker import opened_keys

    model = _mixtral()
    model.save_pretrained(tmp_path / "theirs")
    af.mesh.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
        want = model.state_dict()
        like: dict[str, torch.Tensor] = {}
        for k, v in want.items():
            if "experts" in k:
                local = torch.zeros(v.shape[0] // 2, *v.shape[1:])
                like[k] = DTensor.from_local(
                    local, mesh, [Shard(0)], run_check=False, shape=v.shape, stride=v.stride()
                )
            else:
                like[k] = torch.zeros_like(v)
        with opened_keys() as opened:
            loaded = af.checkpoint.load_pretrained(tmp_path / "theirs", like=like)
    finally:
        af.mesh.destroy_process_group()
    for k, v in want.items():
        got = loaded[k].to_local() if "experts" in k else loaded[k]
        assert torch.equal(got, v[2:] if "experts" in k else v), k
    assert opened and {int(k.split("experts.")[1].split(".")[0]) for k in opened} == {2, 3}, opened


def test_load_pretrained_names_a_missing_or_misshapen_expert(tmp_path):
    from safetensors.torch import load_file, save_file

    model = _qwen_moe()
    model.save_pretrained(tmp_path / "w")
    path = tmp_path / "w" / "model.safetensors"
    tensors = load_file(path)
    like = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    save_file({**tensors, "model.layers.0.mlp.experts.2.up_proj.weight": torch.zeros(8, 15)}, path)
    with pytest.raises(af.checkpoint.CheckpointMismatchError, match=r"experts.2.up_proj.weight.*\(8, 16\)"):
        af.checkpoint.load_pretrained(tmp_path / "w", like=like)
    del tensors["model.layers.0.mlp.experts.2.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(
        af.checkpoint.CheckpointMismatchError, match=r"missing \['model.layers.0.mlp.experts.gate_up"
    ):
        af.checkpoint.load_pretrained(tmp_path / "w", like=like)


def test_per_expert_keys_are_written_only_where_transformers_writes_those_names():
    from transformers import GPT2Config, MixtralConfig, OlmoeConfig, Qwen3MoeConfig, Qwen3VLMoeConfig

    from accelfn.checkpoint.experts import splits_experts

    assert (
        splits_experts(Qwen3MoeConfig()) and splits_experts(OlmoeConfig()) and splits_experts(MixtralConfig())
    )
    assert not splits_experts(Qwen3VLMoeConfig())  # fused on disk too (transposed): not a per-expert layout
    assert not splits_experts(GPT2Config()) and not splits_experts(None)


def test_experts_docstring_example_runs():
    import doctest

    from accelfn.checkpoint import experts

    assert doctest.testmod(experts).failed == 0
