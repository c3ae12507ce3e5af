"""Tensor parallel over a `tp` mesh axis, alone and with ddp / fsdp over the data axes, on real processes
(gloo, through `accelfn launch`) vs one process on the global batch; plans, errors and checkpoints."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import accelfn as af
from accelfn.transforms.shard.tensor_parallel import expand_plan, model_tp_plan
from tests._launch import expect_ok, output_of, run_workers


@pytest.mark.slow
def test_tp2_alone_equals_one_process():
    # the decoders run with sequence and loss parallel, their default; "no..." turns them off. compile:blocks without
    # them is torch 2.13's lost gradient of an AsyncCollectiveTensor input (af.compile waits for it first).
    # remat:compile is torchtitan's Table 5 combination (full AC, per-block compile, sequence parallel): each block's
    # forward compiled inside its checkpoint (the checkpoint inside the graph saved a DeviceMesh on torch 2.13)
    configs = ["llama", "starcoder2", "mistral", "qwen2", "mlp", "mlp:userstyles", "llama:accumulate", "llama:remat",
               "llama:remat:compile", "llama:bf16", "llama:compile", "llama:compile:blocks", "llama:compile:blocks:noseqparallel:nolossparallel",
               "llama:noseqparallel:nolossparallel",
               "starcoder2:noseqparallel:lossparallel:accumulate", "llama:seqparallel:nolossparallel",
               "starcoder2:seqparallel:lossparallel:accumulate", "llama:fp8", "qwen3moe",
               "qwen3moe:seqparallel:lossparallel", "deepseekv3", "deepseekv3:seqparallel:lossparallel"]  # fmt: skip
    proc = run_workers("tp_worker.py", 2, "tp=2", *configs, timeout=600)
    expect_ok(proc, configs, 2)
    assert proc.stdout.count("OK fsdp without a data axis refused") == 2, output_of(proc)


@pytest.mark.slow
def test_dp2_x_tp2_on_four_processes_equals_one_process(tmp_path):
    # gemma3: DDP broadcasts its buffers each step, `embed_scale` as the DTensor tensor parallel made it (beside
    # the plain rotary inv_freq) and the run still equals one process
    # compile under fsdp x tp compiles each decoder layer on its own, as torchtitan does; sgd without sequence
    # parallel: the norms' DTensors (fsdp mesh) beside the split weights' (fsdp x tp mesh) in one update
    configs = ["llama", "starcoder2", "llama:accumulate", "llama:fsdp", "mlp:fsdp:accumulate", "llama:compile",
               "llama:fsdp:noseqparallel:lossparallel:loader", "llama:loader:nolossparallel",
               "llama:fsdp:seqparallel:compile", "llama:fsdp:noseqparallel:nolossparallel:sgd",
               "llama:fsdp:fp8", f"llama:save={tmp_path / 'ckpt'}", "qwen3moe:fsdp:seqparallel:lossparallel:accumulate",
               f"qwen3moe:save={tmp_path / 'moe'}",
               "gemma3:noseqparallel:nolossparallel"]  # fmt: skip
    # the mesh from the launcher: accelfn launch --mesh dp=2,tp=2
    proc = run_workers("tp_worker.py", 4, "env", *configs, timeout=600, launch_args=("--mesh", "dp=2,tp=2"))
    expect_ok(proc, configs, 4)
    assert proc.stdout.count("OK cp with tp") == 4, output_of(proc)
    # the dp2 x tp2 states load on one process, in the Hugging Face layout transformers reads (Qwen3-MoE: its
    # experts whole, under their own names)
    from transformers import AutoModelForCausalLM

    for name in ("ckpt", "moe"):
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-hf")
        ref = AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-ref")
        assert [n for n, _ in hf.named_parameters()] == [n for n, _ in ref.named_parameters()]
        for (n, p), (_, q) in zip(hf.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=2e-5, msg=n)
        step = af.train_step(lambda m, b: m(b).logits.sum(), af.optim.adamw(1e-3))
        like = step.init(AutoModelForCausalLM.from_pretrained(tmp_path / f"{name}-ref"))
        state = af.checkpoint.load(tmp_path / name, like=like)
        assert int(state.step) == 4
        for n, p in hf.named_parameters():
            assert torch.equal(state.params[n], p), n


@pytest.mark.slow
def test_hsdp_x_tp_on_eight_processes_equals_one_process():
    configs = ["llama:hsdp", "mlp:hsdp:accumulate"]  # dp=2 replicas x fsdp=2 shards x tp=2 splits
    expect_ok(run_workers("tp_worker.py", 8, "dp=2,fsdp=2,tp=2", *configs, timeout=600), configs, 8)


@pytest.mark.slow
def test_checkpoints_move_between_tp_fsdp_and_one_process(tmp_path):
    proc = run_workers("tp_ckpt_worker.py", 4, str(tmp_path), timeout=600)
    out = output_of(proc)
    assert proc.returncode == 0, out
    assert proc.stdout.count("TP CKPT OK") == 4, out
    # and on one process: the FSDP x TP checkpoint (with _StridedShard pieces) loads whole
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp-tp-hf")
    step = af.train_step(lambda m, b: m(b).logits.sum(), af.optim.adamw(1e-3))
    state = af.checkpoint.load(
        tmp_path / "fsdp-tp", like=step.init(AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp-tp-hf"))
    )
    assert int(state.step) == 2
    for n, p in hf.named_parameters():
        assert torch.equal(state.params[n], p), n


# ---- plans and errors (one process) -----------------------------------------------------------------------------
def llama(heads=4, kv=2, tie=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tie)  # fmt: skip
    return LlamaForCausalLM(cfg)


def test_hugging_face_models_bring_their_plan():
    plan = model_tp_plan(llama())
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["lm_head"] == "colwise_gather_output"
    styles = expand_plan(llama(), plan, 2)
    assert "model.layers.1.mlp.down_proj" in styles and "model.embed_tokens" in styles
    from tests.models import tiny_gpt2

    assert model_tp_plan(tiny_gpt2()) is None  # GPT-2 (Conv1D layers) has none: a user plan is needed


def test_plan_errors_name_the_entry_the_size_and_the_module():
    with pytest.raises(ValueError, match=r"tp_plan entry 'layers\.\*\.attn\.q' matches no module"):
        expand_plan(llama(), {"layers.*.attn.q": "colwise"}, 2)
    with pytest.raises(ValueError, match=r"tp=4 does not divide the model's num_key_value_heads = 2"):
        expand_plan(llama(), {"model.layers.*.self_attn.q_proj": "colwise"}, 4)
    with pytest.raises(ValueError, match=r"tp=3 does not divide fc\.out_features = 4"):
        expand_plan(_Net(), {"fc": "colwise"}, 3)
    with pytest.raises(ValueError, match=r"tp_plan\['fc'\] = 'diagonal' is not a style"):
        expand_plan(_Net(), {"fc": "diagonal"}, 2)
    from tests.models import tiny_gpt2

    with pytest.raises(ValueError, match=r"module 'transformer\.h\.0\.mlp\.c_fc' is a Conv1D"):
        expand_plan(tiny_gpt2(), {"transformer.h.*.mlp.c_fc": "colwise"}, 2)


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                         num_experts_per_tok=2, tie_word_embeddings=False)  # fmt: skip
    return Qwen3MoeForCausalLM(cfg)


def test_a_moe_models_plan_keeps_its_experts_whole_without_ep():
    from accelfn.transforms.shard.tensor_parallel import whole_experts

    model = qwen3_moe()
    own = model_tp_plan(model)  # transformers splits the experts: packed gate_up halves, down_proj rowwise
    assert own["model.layers.*.mlp.experts.gate_up_proj"] == "packed_colwise"
    assert own["model.layers.*.mlp.experts"] == "moe_tp_experts"
    notes: list[str] = []
    plan = whole_experts(model, own, notes)
    experts = ["model.layers.*.mlp.experts", "model.layers.*.mlp.experts.down_proj",
               "model.layers.*.mlp.experts.gate_up_proj"]  # fmt: skip
    assert sorted(set(own) - set(plan)) == experts
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"  # a dense MLP's rowwise stays (mlp_only_layers)
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert len(notes) == 1 and "the experts stay whole on every tp rank" in notes[0], notes
    assert experts[2] in notes[0], notes
    # what is left splits the attention only; the experts' params are untouched
    attention = {k: v for k, v in plan.items() if ".mlp." not in k}  # (the dense MLP's: for mlp_only_layers)
    styles = expand_plan(model, attention, 2)
    assert "model.layers.1.self_attn.q_proj" in styles and not any(".experts" in n for n in styles)
    dense = model_tp_plan(llama())
    assert whole_experts(qwen3_moe(), dense, notes) == dense  # no experts: nothing left out, nothing said
    assert len(notes) == 1
    # sequence parallel (asked for): the MoE block, whose experts stay whole, gathers the sequence in, scatters it out
    from accelfn.transforms.shard.tensor_parallel import match_plan, sequence_parallel_styles

    styles = sequence_parallel_styles(model, match_plan(model, attention, 2), loss_parallel=True)
    assert type(styles["model.layers.0.mlp"]).__name__ == "PrepareModuleInputOutput"
    assert type(styles["model.layers.0.self_attn"]).__name__ == "PrepareModuleInput"


def test_a_models_own_plan_with_a_style_accelfn_does_not_know_is_refused_by_name():
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from accelfn.transforms.shard.tensor_parallel import _check_model_styles, whole_experts

    cfg = DeepseekV2Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                           kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
                           v_head_dim=8)  # fmt: skip
    model = DeepseekV2ForCausalLM(cfg)
    plan = whole_experts(model, model_tp_plan(model), [])  # its experts' entries go; MLA's projection stays
    with pytest.raises(ValueError, match=r"DeepseekV2ForCausalLM's own tp plan \(config\.base_model_tp_plan\) maps "
                       r"'model\.layers\.\*\.self_attn\.kv_a_proj_with_mqa' to 'mla_kv_a_proj'"):  # fmt: skip
        _check_model_styles(model, plan)
    _check_model_styles(qwen3_moe(), whole_experts(qwen3_moe(), model_tp_plan(qwen3_moe()), []))  # all known


def test_a_user_plan_naming_transformers_moe_styles_is_refused_by_name():
    with pytest.raises(ValueError, match=r"tp_plan\['model\.layers\.\*\.mlp\.experts\.gate_up_proj'\] = "
                       r"'packed_colwise' is not a style accelfn knows \(transformers' style for MoE experts"):  # fmt: skip
        expand_plan(qwen3_moe(), {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise"}, 2)
    with pytest.raises(ValueError, match=r"\['model\.layers\.\*\.mlp\.experts'\] = 'moe_tp_experts' is not"):
        expand_plan(qwen3_moe(), {"model.layers.*.mlp.experts": "moe_tp_experts"}, 2)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


def test_shard_arguments_are_checked_before_anything_runs():
    base = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1))
    with (
        af.Mesh({"dp": -1}, device="cpu") as mesh,
        pytest.raises(ValueError, match="loss_parallel=True needs a tp"),
    ):
        af.shard(base, mesh, loss_parallel=True)
    with (
        af.Mesh({"dp": -1}, device="cpu") as mesh,
        pytest.raises(ValueError, match="tp_plan given, but the mesh"),
    ):
        af.shard(base, mesh, tp_plan={"fc": "colwise"})
    with af.Mesh({"dp": -1, "tp": 1}, device="cpu") as mesh:  # tp=1: nothing to split, plain data parallel
        step = af.shard(base, mesh)
        step.init(_Net())
        assert "tensor parallel" not in repr(step)
    with pytest.raises(ValueError, match=r"product of the sizes|world"):
        af.Mesh({"dp": 2, "tp": 2}, device="cpu")  # one process here, not 4


def test_sequence_parallel_needs_a_decoder_it_knows():
    from accelfn.transforms.shard.tensor_parallel import match_plan, sequence_parallel_styles

    styles = sequence_parallel_styles(
        llama(), match_plan(llama(), model_tp_plan(llama()), 2), loss_parallel=False
    )
    assert type(styles["model.layers.0.input_layernorm"]).__name__ == "SequenceParallel"
    assert type(styles["model.layers.1.mlp"]).__name__ == "PrepareModuleInput"
    with pytest.raises(ValueError, match=r"sequence_parallel=True\) knows Hugging Face decoders"):
        sequence_parallel_styles(nn.Sequential(_Net(), _Net()), {}, loss_parallel=False)


def test_optimizer_clip_inside_the_chain_is_refused_under_tensor_parallel():
    from accelfn.optim.base import apply_gradients_on_shards

    tx = af.optim.chain(af.optim.clip_by_global_norm(1.0), af.optim.sgd(0.1))
    with pytest.raises(ValueError, match="clip_grad_norm=max_norm"):
        apply_gradients_on_shards(tx, {}, (), {})


def test_a_models_own_plan_that_names_none_of_its_modules_is_an_error() -> None:
    # a wrapper renames the modules (and forwards the config): the plan, read from the config, matches nothing
    from accelfn.transforms.shard.tensor_parallel import _present, model_tp_plan

    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner, self.config = inner, inner.config

    model = qwen3_moe()
    assert _present(model, model_tp_plan(model), []) != {}  # the model itself: its plan applies
    with pytest.raises(
        ValueError, match=r"the tp plan Wrapper brings \(\d+ entries, e.g. 'layers.*names none of"
    ):
        _present(Wrapper(model), model_tp_plan(Wrapper(model)), [])


def test_a_pipeline_stage_that_holds_nothing_the_plan_splits_is_not_an_error() -> None:
    # a head-only stage: its stand-in for `model` hides the layers the plan names; nothing to split, said in a note
    from accelfn.stages import Skip
    from accelfn.transforms.shard.tensor_parallel import _present

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model, self.score = Skip(nn.Linear(4, 4), {}), nn.Linear(4, 2)

    notes: list[str] = []
    assert _present(Stage(), {"model.layers.*.self_attn.q_proj": "colwise"}, notes) == {}
    assert "left out: ['model.layers.*.self_attn.q_proj']" in notes[0]
