"""PEFT (LoRA) adapters: training under accelfn, saving in PEFT's layout, merging, loading back."""

from __future__ import annotations

import json
import os

import pytest
import torch

import accelfn as af
from tests._launch import output_of, run_workers
from tests.models import lm_batches, tiny_llama

peft = pytest.importorskip("peft")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TARGETS = ["q_proj", "v_proj"]


def lora_model(r: int = 4, dtype: torch.dtype = torch.float32, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    base = tiny_llama().to(dtype)
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=r, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, **extra)
    )
    with torch.no_grad():  # PEFT starts lora_B at 0: give it values, so an adapter changes the logits
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(1))
    return model


def loss_fn(model, b):
    return af.losses.cross_entropy(model(input_ids=b["input_ids"]).logits[:, :-1].float(), b["labels"][:, 1:])


def trained(model, steps: int = 3):
    step = af.train_step(loss_fn, af.optim.adamw(1e-2))
    state = step.init(model)
    for b in lm_batches(1) * steps:
        state, _ = step(state, b)
    return step, state


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=lm_batches(1, seed=5)[0]["input_ids"]).logits


def test_only_the_lora_params_train_and_have_optimizer_state():
    model = lora_model()
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    step, state = trained(model)
    lora = sorted(n for n in state.params if "lora_" in n)
    assert len(lora) == 2 * 2 * len(TARGETS)  # 2 layers x targets x (A, B)
    moments = sorted(p for p, _ in af.tree.flatten_with_path(state.opt_state) if p.startswith(("mu.", "nu.")))
    assert moments == sorted(f"{m}.{n}" for m in ("mu", "nu") for n in lora)
    for n, before in base_before.items():
        assert torch.equal(state.params[n], before), n


def test_saved_adapter_is_in_peft_layout_and_peft_loads_it_with_identical_logits(tmp_path):
    model = lora_model()
    _, state = trained(model)
    af.checkpoint.save_adapter(tmp_path / "adapter", state, model)
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    keys = set(af.checkpoint.load_pretrained(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert keys == set(peft.get_peft_model_state_dict(model))  # PEFT's own keys, no adapter name
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["inference_mode"] is True
    torch.manual_seed(0)
    reloaded = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path / "adapter")
    assert torch.equal(logits(reloaded), logits(model))


def test_merged_export_loads_in_transformers_with_the_same_logits_and_leaves_the_model_unmerged(tmp_path):
    from transformers import AutoModelForCausalLM

    model = lora_model()
    _, state = trained(model)
    before = logits(model)
    params_before = {n: p.detach().clone() for n, p in state.params.items()}
    af.checkpoint.save_adapter(tmp_path / "merged", state, model, merge=True)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert type(merged).__name__ == "LlamaForCausalLM"
    assert not any("lora" in n for n in merged.state_dict())
    torch.testing.assert_close(logits(merged), before, rtol=0, atol=1e-5)
    assert torch.equal(logits(model), before)  # the training model is not merged
    assert all(torch.equal(state.params[n], v) for n, v in params_before.items())


@pytest.mark.filterwarnings("ignore:Model (has|with) `tie_word_embeddings=True`:UserWarning")
@pytest.mark.parametrize(
    "targets", [["q_proj", "lm_head"], ["q_proj"]], ids=["adapted-head", "head-untouched"]
)
def test_merged_export_of_a_tied_model_unties_the_embeddings_only_when_the_merge_changed_one(
    tmp_path, targets
):
    # an adapter on lm_head of a tied model: the merged head differs from the embedding, so config.json must
    # say tie_word_embeddings=False, or a loader that re-ties them drops one (PEFT's merge_and_unload changes both)
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    model = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    )
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(1))
    _, state = trained(model, steps=1)
    before = logits(model)
    af.checkpoint.save_adapter(tmp_path / "merged", state, model, merge=True)
    written = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert written["tie_word_embeddings"] is ("lm_head" not in targets)
    assert (
        model.get_base_model().config.tie_word_embeddings is True
    )  # the training model's config is untouched
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert (merged.lm_head.weight is merged.model.embed_tokens.weight) is ("lm_head" not in targets)
    torch.testing.assert_close(logits(merged), before, rtol=0, atol=1e-5)


def test_merged_export_of_one_adapter_keeps_the_original_of_a_module_another_adapter_saves(tmp_path):
    # adapter "one" trains a copy of lm_head (modules_to_save); merging "two" must write the original lm_head
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                modules_to_save=["lm_head"], lora_dropout=0.0), adapter_name="one")  # fmt: skip
    model.add_adapter("two", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["o_proj"], lora_dropout=0.0))
    for adapter in ("one", "two"):
        model.set_adapter(adapter)
        _, state = trained(model, steps=2)
    model.set_adapter("two")
    before = logits(model)
    af.checkpoint.save_adapter(tmp_path / "two", state, model, merge=True, adapter_name="two")
    merged, info = AutoModelForCausalLM.from_pretrained(tmp_path / "two", output_loading_info=True)
    assert not info["missing_keys"], (
        info
    )  # lm_head.weight was left out: transformers initialised it at random
    torch.testing.assert_close(logits(merged), before, rtol=0, atol=1e-5)


def test_saved_adapter_config_equals_peft_s_own_and_auto_peft_model_loads_it(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tiny_llama().save_pretrained(tmp_path / "base")  # a base with a name, as from the Hub
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))  # no task_type  # fmt: skip
    _, state = trained(model, steps=1)
    af.checkpoint.save_adapter(tmp_path / "ours", state, model)
    model.save_pretrained(tmp_path / "peft")
    ours, theirs = (json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("ours", "peft"))
    assert ours == theirs, {
        k: (ours.get(k), theirs.get(k)) for k in {*ours, *theirs} if ours.get(k) != theirs.get(k)
    }
    assert ours["auto_mapping"]["base_model_class"] == "LlamaForCausalLM"
    loaded = peft.AutoPeftModel.from_pretrained(tmp_path / "ours")  # finds the base class from auto_mapping
    assert torch.equal(logits(loaded), logits(model))


def test_load_adapter_reads_a_peft_folder_into_a_state(tmp_path):
    source = lora_model()
    _, trained_state = trained(source)
    source.save_pretrained(tmp_path / "peft")  # written by PEFT itself
    model = lora_model()
    state = af.train_step(loss_fn, af.optim.adamw(1e-2)).init(model)
    assert not torch.equal(logits(model), logits(source))
    loaded = af.checkpoint.load_adapter(tmp_path / "peft", like=state, model=model)
    for n in (n for n in state.params if "lora_" in n):
        assert loaded.params[n] is state.params[n]  # in place: the model sees the values
        assert torch.equal(loaded.params[n], trained_state.params[n]), n
    assert torch.equal(logits(model), logits(source))


def test_load_adapter_with_another_rank_names_the_mismatch(tmp_path):
    model = lora_model(r=4)
    af.checkpoint.save_adapter(tmp_path / "r4", dict(model.named_parameters()), model)
    other = lora_model(r=8)
    with pytest.raises(af.checkpoint.CheckpointMismatchError, match="r: saved 4, model 8"):
        af.checkpoint.load_adapter(tmp_path / "r4", like=dict(other.named_parameters()), model=other)


def test_load_adapter_refuses_settings_that_change_what_the_weights_compute(tmp_path):
    # lora_alpha changes the scaling: the same weights, other logits (PEFT builds the adapter from the saved
    # config; here the model's adapter exists already, so a difference is an error, not a silent change)
    model = lora_model()
    af.checkpoint.save_adapter(tmp_path / "a8", dict(model.named_parameters()), model)
    torch.manual_seed(0)
    other = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS))
    with pytest.raises(af.checkpoint.CheckpointMismatchError, match="lora_alpha: saved 8, model 16"):
        af.checkpoint.load_adapter(tmp_path / "a8", like=dict(other.named_parameters()), model=other)
    # other layers adapted: named, without pointing to an option load_adapter does not have
    torch.manual_seed(0)
    wider = peft.get_peft_model(
        tiny_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=[*TARGETS, "k_proj"])
    )
    (tmp_path / "a8" / "adapter_config.json").write_text(
        json.dumps(
            {**json.loads((tmp_path / "a8" / "adapter_config.json").read_text()), "target_modules": None}
        )
    )
    with pytest.raises(af.checkpoint.CheckpointMismatchError, match="cover different layers") as e:
        af.checkpoint.load_adapter(tmp_path / "a8", like=dict(wider.named_parameters()), model=wider)
    assert "strict=False" not in str(e.value)


def test_save_adapter_writes_into_a_folder_holding_a_tokenizer_and_keeps_it(tmp_path):
    # the usual order: tokenizer.save_pretrained(out), then the model or adapter; the tokenizer stays
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    (out / "README.md").write_text("my model")
    model = lora_model()
    af.checkpoint.save_adapter(out, dict(model.named_parameters()), model)
    assert (out / "adapter_model.safetensors").exists() and (out / "README.md").read_text() == "my model"
    assert (out / "tokenizer.json").exists()


def test_save_adapter_refuses_a_model_that_is_not_a_peft_model(tmp_path):
    with pytest.raises(TypeError, match="must be the PeftModel"):
        af.checkpoint.save_adapter(tmp_path / "x", {}, tiny_llama())


def test_fsdp_keeps_a_bf16_base_and_shards_mixed_dtype_trainables_apart():
    # bf16 base, fp32 LoRA and trainable bf16 norm copies in one block: FSDP2 wants one trainable dtype per unit
    model = lora_model(dtype=torch.bfloat16, modules_to_save=["input_layernorm"])
    with af.Mesh({"dp": -1}, device="cpu") as mesh:
        step = af.shard(af.train_step(loss_fn, af.optim.adamw(1e-2)), mesh, strategy="fsdp")
        state = step.init(model)
        losses = []
        for b in lm_batches(1) * 4:
            state, metrics = step(state, b)
            losses.append(metrics["loss"].item())
    assert losses[-1] < losses[0]
    for n, p in state.params.items():
        assert p.to_local().dtype == (torch.float32 if "lora_" in n else torch.bfloat16), n


@pytest.mark.slow
def test_lora_on_two_ranks_equals_one_process_and_saves_a_peft_adapter(tmp_path):
    configs = [
        "ddp:fp32",
        "fsdp:fp32",
        "fsdp:bf16",
        "fsdp:bf16:norms",
        "fsdp:fp32:autocast",
        "fsdp:bf16:autocast",
        "ddp:fp32:compile",
        "fsdp:bf16:autocast:compile",
    ]  # compile: per block, before FSDP2
    proc = run_workers("peft_worker.py", 2, str(tmp_path), *configs, timeout=400, env={"HF_HUB_OFFLINE": "1"})
    out = output_of(proc)
    assert proc.returncode == 0, out
    for c in configs:
        strategy, dtype, *extra = c.split(":")
        for rank in (0, 1):
            assert f"rank {rank}: OK {'-'.join([strategy, dtype, *sorted(extra)])} " in proc.stdout, out


@pytest.mark.slow
def test_lora_finetune_example_runs(tmp_path):
    from tests.test_examples import _passes, run_example

    proc = run_example("lora_finetune.py", "--out", str(tmp_path / "run"))
    _passes(proc, "LoRA loss falls and the saved adapter reloads")


# ---- save_pretrained of a PEFT model (the replacement for Accelerate's save_model) ----------------------------
def named_base_model(tmp_path, **lora):
    """A PEFT model over a base loaded from a folder (so the adapter names its base, as one from the Hub)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    tiny_llama().save_pretrained(tmp_path / "base")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, **lora)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(1))
    return model


def adapter_loading_report(model, folder):
    """PEFT's own report of loading `folder` into `model` as another adapter: (missing adapter keys, unexpected)."""
    result = model.load_adapter(folder, adapter_name="check")
    model.delete_adapter("check")
    tuner = model.peft_config[model.active_adapter].peft_type.value.lower()
    return [k for k in result.missing_keys if f"{tuner}_" in k], list(result.unexpected_keys)


def test_save_pretrained_of_a_peft_model_writes_what_peft_save_pretrained_writes_and_both_libraries_load_it(
    tmp_path,
):
    # the bug: it wrote the PeftModel's state_dict (base_model.model.*) with config.json, which
    # AutoModelForCausalLM loaded as a randomly initialised model with no error
    from transformers import AutoModelForCausalLM

    model = named_base_model(tmp_path)
    step, state = trained(model)
    af.checkpoint.save_pretrained(tmp_path / "ours", state, model=step.model)
    model.save_pretrained(
        tmp_path / "peft"
    )  # the reference: PEFT itself (the model holds the trained values)
    assert sorted(os.listdir(tmp_path / "ours")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert sorted(os.listdir(tmp_path / "peft")) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    ours, theirs = (
        af.checkpoint.load_pretrained(tmp_path / d / "adapter_model.safetensors") for d in ("ours", "peft")
    )
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    configs = [json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("ours", "peft")]
    assert configs[0] == configs[1]
    for k, v in ours.items():  # the trained values, not the initial ones
        name = k.replace(".weight", ".default.weight")
        assert torch.equal(v, state.params[name]), k
    expected = logits(model)
    # PEFT: no adapter key missing or unexpected, the same logits
    assert adapter_loading_report(model, tmp_path / "ours") == ([], [])
    reloaded = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "ours"
    )
    assert torch.equal(logits(reloaded), expected)
    assert torch.equal(logits(peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "ours")), expected)
    # transformers: the base from adapter_config.json's base_model_name_or_path, the adapter on it
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not any(info.values()), info
    assert torch.equal(logits(loaded), expected)


def test_save_pretrained_of_a_peft_model_with_merge_writes_a_model_transformers_loads_without_missing_keys(
    tmp_path,
):
    from transformers import AutoModelForCausalLM

    model = lora_model()
    step, state = trained(model)
    expected = logits(model)
    af.checkpoint.save_pretrained(
        tmp_path / "merged", state, model=step.model, merge=True, max_shard_size="40KB"
    )
    files = sorted(os.listdir(tmp_path / "merged"))
    assert "model.safetensors.index.json" in files and not any(f.startswith("adapter") for f in files), files
    merged, info = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not any(info.values()), info
    torch.testing.assert_close(logits(merged), expected, rtol=0, atol=1e-5)
    written = af.checkpoint.load_pretrained(tmp_path / "merged")
    for (
        n,
        p,
    ) in merged.named_parameters():  # every weight is the merged one written, none initialised at random
        assert torch.equal(p, written[n]), n


@pytest.mark.parametrize("merge", [False, True], ids=["adapter", "merged"])
def test_save_pretrained_refuses_a_peft_model_of_another_rank_than_the_state_before_writing(tmp_path, merge):
    # an adapter of rank 4 saved with model= a PeftModel of rank 8 (the same names) would write an
    # adapter_config.json (or merged weights) that does not go with the adapter trained
    step, state = trained(lora_model(r=4), steps=1)
    with pytest.raises(
        ValueError, match=r"lora_A\.default\.weight' has shape \(4, 32\) in the state but \(8, 32\)"
    ):
        af.checkpoint.save_pretrained(tmp_path / "out", state, model=lora_model(r=8), merge=merge)
    assert not (tmp_path / "out").exists()
    af.checkpoint.save_pretrained(tmp_path / "out", state, model=step.model, merge=merge)  # its own: saved


def test_save_pretrained_of_the_peft_module_itself_and_of_several_adapters_follows_peft(tmp_path):
    # the module form (its own values), and a second adapter in a subfolder of its name, as PEFT writes them
    model = lora_model()
    model.add_adapter("two", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["o_proj"], lora_dropout=0.0))
    af.checkpoint.save_pretrained(tmp_path / "ours", model)
    model.save_pretrained(tmp_path / "peft")

    def tree(root):
        return sorted(
            str(p.relative_to(root)) for p in root.rglob("*") if p.name != "README.md"
        )  # PEFT's card

    assert tree(tmp_path / "ours") == tree(tmp_path / "peft") == [
        "adapter_config.json", "adapter_model.safetensors",
        "two", "two/adapter_config.json", "two/adapter_model.safetensors"]  # fmt: skip
    for sub in ("", "two"):
        ours = af.checkpoint.load_pretrained(tmp_path / "ours" / sub / "adapter_model.safetensors")
        theirs = af.checkpoint.load_pretrained(tmp_path / "peft" / sub / "adapter_model.safetensors")
        assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours), sub
        configs = [
            json.loads((tmp_path / d / sub / "adapter_config.json").read_text()) for d in ("ours", "peft")
        ]
        assert configs[0] == configs[1], sub
    torch.manual_seed(0)
    again = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path / "ours")
    again.load_adapter(tmp_path / "ours" / "two", adapter_name="two")
    for adapter in ("default", "two"):
        model.set_adapter(adapter)
        again.set_adapter(adapter)
        assert torch.equal(logits(again), logits(model)), adapter


def test_save_pretrained_replaces_the_model_files_of_an_earlier_save_in_the_folder(tmp_path):
    # transformers loads a folder holding config.json and an adapter as "that model plus the adapter": an old
    # model left beside a new adapter (or an old adapter beside new weights) would be applied silently
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    model = named_base_model(tmp_path)
    af.checkpoint.save_pretrained(out, model, merge=True)  # a merged model first
    (out / "tokenizer.json").write_text("{}")
    af.checkpoint.save_pretrained(out, model)  # then the adapter: the merged weights must go
    assert sorted(os.listdir(out)) == [  # (the generation settings of the base stay)
        "adapter_config.json", "adapter_model.safetensors", "generation_config.json", "tokenizer.json"]  # fmt: skip
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(logits(loaded), logits(model))  # base + adapter once, not the merged model + adapter
    af.checkpoint.save_pretrained(out, model, merge=True)  # and back: the adapter must go
    assert sorted(os.listdir(out)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=1e-5)


def test_save_pretrained_refuses_peft_names_under_a_transformers_config_and_merge_without_peft(tmp_path):
    from transformers import AutoModelForCausalLM

    model = named_base_model(tmp_path)
    config = AutoModelForCausalLM.from_pretrained(tmp_path / "base").config  # names LlamaForCausalLM
    with pytest.raises(ValueError, match=r"LlamaForCausalLM .*missing 21: .*unexpected .*save_adapter") as e:
        af.checkpoint.save_pretrained(tmp_path / "x", dict(model.named_parameters()), config=config)
    assert "'base_model.model." in str(e.value) and not (tmp_path / "x").exists()
    with pytest.raises(TypeError, match="merge=True merges a PEFT adapter"):
        af.checkpoint.save_pretrained(tmp_path / "y", tiny_llama(), merge=True)
    with pytest.raises(TypeError, match="config= does not go with a PeftModel"):
        af.checkpoint.save_pretrained(tmp_path / "z", model, config=config)


@pytest.mark.filterwarnings("ignore:Model (has|with) `tie_word_embeddings=True`:UserWarning")
@pytest.mark.parametrize(
    "targets", [["embed_tokens"], ["embed_tokens", "lm_head"]], ids=["adapted-embedding", "adapted-both"]
)
def test_merged_export_with_lora_on_tied_embeddings_writes_both_untied_and_transformers_computes_the_same(
    tmp_path, targets
):
    # LoRA on embed_tokens (and lm_head) of a tied model: merged, the embedding and the head differ
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    model = peft.get_peft_model(
        LlamaForCausalLM(config), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
    )
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "lora_embedding_B" in n:
                p.normal_(std=0.05, generator=torch.Generator().manual_seed(1))
    step, state = trained(model, steps=2)
    expected = logits(model)
    af.checkpoint.save_pretrained(tmp_path / "merged", state, model=step.model, merge=True)
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is False
    written = af.checkpoint.load_pretrained(tmp_path / "merged")
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(written)
    assert not torch.equal(written["model.embed_tokens.weight"], written["lm_head.weight"])
    merged, info = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True)
    assert not any(info.values()), info
    assert merged.lm_head.weight is not merged.model.embed_tokens.weight
    for n, p in merged.named_parameters():
        assert torch.equal(p, written[n]), n
    torch.testing.assert_close(logits(merged), expected, rtol=0, atol=1e-5)


def test_save_pretrained_of_a_peft_model_from_an_fsdp_state_gathers_the_adapter(tmp_path):
    model = lora_model()
    with af.Mesh({"dp": -1}, device="cpu") as mesh:
        step = af.shard(af.train_step(loss_fn, af.optim.adamw(1e-2)), mesh, strategy="fsdp")
        state = step.init(model)
        for b in lm_batches(1) * 2:
            state, _ = step(state, b)
        assert all(hasattr(p, "full_tensor") for n, p in state.params.items() if "lora_" in n)
        af.checkpoint.save_pretrained(tmp_path / "adapter", state, model=step.model)
        expected = logits(step.model)
    torch.manual_seed(0)
    reloaded = peft.PeftModel.from_pretrained(tiny_llama(), tmp_path / "adapter")
    assert adapter_loading_report(reloaded, tmp_path / "adapter") == ([], [])
    torch.testing.assert_close(logits(reloaded), expected, rtol=0, atol=1e-6)


def test_tensor_parallel_of_a_peft_model_is_refused_by_name(tmp_path) -> None:
    # its LoRA layers wrap the Linear layers the plan splits, and the plan's names lack PeftModel's prefix: without
    # the check, tp=2 split nothing and said so only in a note (every rank trained a full replica)
    script = tmp_path / "train_lora_tp.py"
    script.write_text(
        "import torch, peft, accelfn as af\n"
        "from tests.models import tiny_llama\n"
        "model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=['q_proj', 'v_proj']))\n"
        "step = af.shard(af.train_step(lambda m, b: m(input_ids=b).logits.float().mean(), af.optim.adamw(1e-3)),\n"
        "                af.Mesh.from_env())\n"
        "state = step.init(model)\n"
        "state, _ = step(state, torch.zeros(2, 8, dtype=torch.long))\n"
    )
    with pytest.raises(
        ValueError,
        match=r"tensor parallel \(tp=2\) of a PEFT model by its own plan is not supported.*data-paral",
    ):
        af.dry_run(script, nproc_per_node=2, mesh="tp=2", search=False)
