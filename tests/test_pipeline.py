"""Pipeline-parallel training (`af.pipeline(step, mesh, ...)`): the split, the errors, and real runs over gloo
through our launcher checked against one process on the global batch (tests/workers/pp_train_worker.py)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import accelfn as af
from accelfn.stages import balanced_split, carve, split_at
from accelfn.transforms.pipeline import SCHEDULES, bubble_fraction
from tests._launch import output_of, run_workers
from tests.models import tiny_gpt2


def llama(layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=False)  # fmt: skip
    return LlamaForCausalLM(cfg)


def lm_loss(model, b):
    logits = model(input_ids=b["input_ids"]).logits
    return af.losses.cross_entropy(logits[:, :-1], b["input_ids"][:, 1:])


# ---- the split ------------------------------------------------------------------------------------------------
def test_a_decoder_splits_by_layers_balanced_by_parameters_with_embeddings_first_and_head_last():
    model = llama(4)
    split = balanced_split(model, 2)
    assert split.points == ("model.layers.2",)
    assert sum(split.stage_params) == sum(p.numel() for p in model.parameters())
    assert split.owner["model.embed_tokens"] == 0 and split.owner["lm_head"] == 1
    assert "stage 0: model.embed_tokens" in split.describe() and "stage 1:" in split.describe()
    four = balanced_split(model, 4)
    assert len(four.points) == 3 and max(four.stage_params) < 1.3 * min(four.stage_params)


def test_carving_keeps_a_stage_under_its_hugging_face_names_and_ties_the_head_between_stages():
    model = tiny_gpt2(n_layer=4)
    names = {n for n, _ in model.named_parameters()}
    split = balanced_split(model, 2)
    tied = carve(model, split, [1])
    kept = {n for n, _ in model.named_parameters()}
    assert kept < names and "transformer.h.0.attn.c_attn.weight" not in kept
    assert "transformer.h.3.attn.c_attn.weight" in kept and "transformer.ln_f.weight" in kept
    assert tied == {"transformer.wte.weight": (0, 1)}  # the head's weight, held by both end stages
    assert model.lm_head.weight is model.transformer.wte.weight
    assert type(model.transformer.h[0]).__name__ == "Skip"


def test_bad_splits_are_named_errors_before_any_step():
    model = llama(2)
    with pytest.raises(ValueError, match="split point 'model.layer.1' is not a module.*model.layers.1"):
        split_at(model, ["model.layer.1"])
    with pytest.raises(ValueError, match="distinct and in forward"):
        split_at(model, ["model.layers.1", "model.layers.0"])
    with pytest.raises(ValueError, match="4 pipeline stages but the model has only 2 decoder layers"):
        balanced_split(model, 4)
    with pytest.raises(ValueError, match="stage 1 of 2 has no parameters"):
        split_at(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), ["1"])


def test_bubble_arithmetic():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, 2) == pytest.approx(1.5 / 9.5)
    assert bubble_fraction(1, 8) == 0


def test_bad_arguments_are_named_errors():
    step = af.train_step(lm_loss, af.optim.sgd(0.1))
    with pytest.raises(ValueError, match="schedule must be one of"):
        af.pipeline(step, microbatches=2, schedule="pipedream")
    with pytest.raises(ValueError, match="runs one stage per rank"):
        af.pipeline(step, microbatches=2, schedule="1f1b", stages_per_rank=2)
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        af.pipeline(step, microbatches=2, schedule="zbv", stages_per_rank=3)
    with (
        af.Mesh({"dp": 1}, device="cpu") as mesh,
        pytest.raises(ValueError, match="the mesh has no 'pp' axis"),
    ):
        af.pipeline(step, mesh, microbatches=2)
    with pytest.raises(TypeError, match="expected a training Step or an nn.Module"):
        af.pipeline("model", microbatches=2)
    with pytest.raises(ValueError, match="needs a mesh with a 'pp' axis"):
        af.pipeline(step, microbatches=2).init(llama(2))


def test_one_stage_pipeline_equals_the_plain_step_and_checks_micro_batches():
    data = {"input_ids": torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))}
    plain = af.train_step(lm_loss, af.optim.adamw(1e-3), clip_grad_norm=1.0)
    ref = plain.init(llama(2), seed=1)
    ref, ref_m = plain(ref, data)
    with af.Mesh({"pp": 1}, device="cpu") as mesh:
        step = af.pipeline(af.train_step(lm_loss, af.optim.adamw(1e-3), clip_grad_norm=1.0), mesh, microbatches=4,
                           schedule="gpipe")  # fmt: skip
        state = step.init(llama(2), seed=1)
        assert "pipeline gpipe over pp=1" in str(step)
        state, m = step(state, data)
        torch.testing.assert_close(m["loss"], ref_m["loss"], rtol=1e-6, atol=1e-6)
        for k, v in state.params.items():
            torch.testing.assert_close(v, ref.params[k], rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match=r"batch\['input_ids'\] has 6 rows, which do not split into 4"):
            step(state, {"input_ids": data["input_ids"][:6]})
        with pytest.raises(ValueError, match="eval_step: this model is cut into pipeline stages"):
            af.eval_step(lambda m, b: m(b)).init(step.model)


def test_zero_bubble_schedules_under_fsdp_are_refused_before_any_step():
    # measured: a KeyError in torch's weight-gradient step (zbv, dualpipev) or a wrong update (interleaved_zb)
    with af.Mesh({"pp": 1, "dp": 1}, device="cpu") as mesh:
        for schedule in ("interleaved_zb", "zbv", "dualpipev"):
            step = af.pipeline(
                af.train_step(lm_loss, af.optim.sgd(0.1)), mesh, microbatches=2, schedule=schedule
            )
            with pytest.raises(ValueError, match=f"zero-bubble schedule '{schedule}' splits each backward"):
                af.shard(step, mesh, strategy="fsdp").init(llama(2))


def test_sync_each_microbatch_is_refused_without_fsdp_and_where_accumulate_says_otherwise():
    step = af.train_step(lm_loss, af.optim.sgd(0.1))
    each = "reduce-scatters each micro-batch's gradients into their shards, under af.shard"
    with af.Mesh({"pp": 1, "dp": 1}, device="cpu") as mesh:
        piped = af.pipeline(step, mesh, microbatches=2, sync_each_microbatch=True)
        assert "sync_each_microbatch=True" in repr(piped)
        with pytest.raises(
            ValueError, match=rf"sync_each_microbatch=True\) {each}.*strategy='ddp' keeps whole"
        ):
            af.shard(piped, mesh, strategy="ddp").init(llama(2))
        with pytest.raises(ValueError, match=rf"{each}.*the step has no af.shard"):
            piped.init(llama(2))
        # af.accumulate's own choice beneath a pipeline (whose schedule runs its micro-batches): the same or none
        for acc, pipe in ((False, True), (True, False)):
            both = af.pipeline(
                af.accumulate(step, 2, sync_each_microbatch=acc),
                mesh,
                microbatches=1,
                sync_each_microbatch=pipe,
            )
            with pytest.raises(ValueError, match=rf"accumulate's sync_each_microbatch={acc} says otherwise: pass "
                               rf"af.pipeline\(\.\.\., sync_each_microbatch={acc}\)"):  # fmt: skip
                af.shard(both, mesh, strategy="fsdp").init(llama(2))
        for acc in (None, True):  # agreeing: lowered, the pipeline's sync reducing each micro-batch
            both = af.pipeline(
                af.accumulate(step, 2, sync_each_microbatch=acc),
                mesh,
                microbatches=1,
                sync_each_microbatch=True,
            )
            lowered = af.shard(both, mesh, strategy="fsdp")
            lowered.init(llama(2))
            assert "2 micro-batches, gradients reduce-scattered each) over FSDP2" in str(lowered), str(
                lowered
            )


def test_the_sync_each_microbatch_knob_travels_from_a_written_plan_through_the_config_to_the_script(tmp_path):
    from accelfn import launch_env
    from accelfn.launch.config import Config, ConfigError, PlanConfig, load, save
    from accelfn.launch.launcher import LaunchOptions, resolve
    from accelfn.planner.candidates import Candidate

    chosen = Candidate(
        {"pp": 2, "dp": 2}, "fsdp", pipeline_microbatches=4, pipeline_sync_each_microbatch=True
    )
    assert chosen.knobs()["pipeline_sync_each_microbatch"] is True
    cfg = Config(num_processes=4, mesh="pp=2,dp=2", plan=PlanConfig(**chosen.knobs()))  # as af.plan writes it
    save(cfg, tmp_path / "plan.yaml")
    assert load(tmp_path / "plan.yaml") == cfg
    assert "pipeline_sync_each_microbatch: true" in (tmp_path / "plan.yaml").read_text()
    env = resolve(
        LaunchOptions(script="x.py", config_file=str(tmp_path / "plan.yaml"), cpu=True), environ={}
    ).env
    assert launch_env.knob("pipeline_sync_each_microbatch", "auto", False, environ=env) is True
    assert launch_env.knob("pipeline_sync_each_microbatch", "auto", False, environ={}) is False
    assert launch_env.knob("pipeline_sync_each_microbatch", False, True, environ=env) is False  # the script's
    with pytest.raises(ConfigError, match=r"plan\.pipeline_sync_each_microbatch.*must be true or false"):
        Config.from_dict({"plan": {"pipeline_sync_each_microbatch": "sometimes"}})


def test_a_pp_axis_without_a_pipeline_is_refused_by_shard():
    with af.Mesh({"pp": 1, "dp": 1}, device="cpu") as mesh:
        af.shard(af.train_step(lm_loss, af.optim.sgd(0.1)), mesh).init(llama(2))  # pp=1: nothing to split
    from accelfn.transforms.shard import Shard

    class FakeMesh:
        axis_names = ("pp", "dp")

        def axis_size(self, name):
            return 2

    with pytest.raises(ValueError, match="'pp' axis of size 2, but the step has no af.pipeline"):
        Shard(FakeMesh()).check([])


def test_1f1b_needs_a_micro_batch_per_stage():
    from accelfn.transforms.pipeline import _check_microbatches

    with pytest.raises(ValueError, match="2 micro-batches are fewer than the 4 stages; 1F1B needs"):
        _check_microbatches("1f1b", 2, 4, 4)
    with pytest.raises(ValueError, match="must be a multiple of pp=4"):
        _check_microbatches("interleaved_1f1b", 6, 4, 8)
    _check_microbatches("gpipe", 1, 4, 4)


def test_every_schedule_is_a_torch_schedule():
    from torch.distributed import pipelining

    for info in SCHEDULES.values():
        assert hasattr(pipelining, info.torch_name)


# ---- real processes -------------------------------------------------------------------------------------------
SCHEDULE_CONFIGS = ["llama:gpipe", "llama:1f1b", "gpt2:1f1b", "gpt2:interleaved_1f1b", "llama:looped_bfs",
                    "llama:interleaved_zb", "llama:zbv", "llama:dualpipev", "llama:remat", "llama:accumulate",
                    "llama:split:gpipe", "llama:dropout:remat", "gpt2:dropout:interleaved_1f1b", "llama:bf16",
                    "llama:fp8", "gpt2:compile:interleaved_1f1b"]  # fmt: skip


@pytest.mark.slow
def test_pp2_every_schedule_and_combinator_equals_one_process():
    proc = run_workers("pp_train_worker.py", 2, "pp=2", *SCHEDULE_CONFIGS, timeout=600)
    assert proc.returncode == 0, output_of(proc)
    assert proc.stdout.count("PP OK") == 2 * len(SCHEDULE_CONFIGS), output_of(proc)


# one launch per test, each under the per-test time limit (three chained launches of up to 600 s each were not)
PP_MESHES = [
    ("pp=2,dp=2", ["llama:ddp", "gpt2:fsdp", "llama:fsdp:remat", "gpt2:ddp:accumulate", "gpt2:fsdp:interleaved_1f1b",
                   "llama:fsdp:looped_bfs", "llama:ddp:zbv"]),
    # the stages with sequence and loss parallel (torchtitan's); full remat + compiled per block, as its Table 5
    # runs (each block's forward compiled inside its eager checkpoint under tp)
    ("pp=2,tp=2", ["llama", "llama:compile:remat"]),
    # context parallel inside the stages: the stages' activations are this rank's part of the sequence
    ("pp=2,cp=2", ["llama:remat", "gpt2:interleaved_1f1b"]),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("mesh, configs", PP_MESHES, ids=[m for m, _ in PP_MESHES])
def test_pp2_with_dp_tp_or_cp_equals_one_process(mesh: str, configs: list[str]):
    proc = run_workers("pp_train_worker.py", 4, mesh, *configs, timeout=540)
    assert proc.returncode == 0, output_of(proc)
    assert proc.stdout.count("PP OK") == 4 * len(configs), output_of(proc)


@pytest.mark.slow
def test_pp2_x_cp2_x_tp2_on_eight_processes_equals_one_process():
    # torchtitan's Table 6 layout (without its dp): stages over pp, each stage's blocks split over tp (sequence and
    # loss parallel) and its sequences over cp, each tp rank gathering its own kv heads' keys over cp
    proc = run_workers("pp_train_worker.py", 8, "pp=2,cp=2,tp=2", "llama:remat", timeout=600)
    assert proc.returncode == 0, output_of(proc)
    assert proc.stdout.count("PP OK") == 8, output_of(proc)


@pytest.mark.slow
def test_pp2_x_hsdp_on_eight_processes_equals_one_process():
    # 3-D: pipeline over pp, replicas over dp, shards over fsdp (8 processes on this machine's 2 cores)
    # (and reducing each micro-batch: reduce-scattered over fsdp each, all-reduced over dp in the last)
    configs = ["llama:hsdp:m=2", "llama:hsdp:m=2:each"]
    proc = run_workers("pp_train_worker.py", 8, "pp=2,dp=2,fsdp=2", *configs, timeout=600)
    assert proc.returncode == 0, output_of(proc)
    assert proc.stdout.count("PP OK") == 8 * len(configs), output_of(proc)


@pytest.mark.slow
def test_pp2_x_fsdp2_reducing_each_micro_batch_equals_one_process():
    """af.pipeline(..., sync_each_microbatch=True): each backward reduce-scatters its gradients (the worker counts
    m per FSDP2 unit a step, none again in the schedule's final reduce), and the result is one process's."""
    configs = ["llama:fsdp:each", "gpt2:fsdp:interleaved_1f1b:each", "llama:fsdp:remat:accumulate:each"]
    proc = run_workers("pp_train_worker.py", 4, "pp=2,dp=2", *configs, timeout=540)
    assert proc.returncode == 0, output_of(proc)
    assert proc.stdout.count("PP OK") == 4 * len(configs), output_of(proc)


@pytest.mark.slow
def test_reducing_each_micro_batch_with_units_the_last_micro_batch_leaves_out_equals_one_process():
    """FSDP2 units (blocks) the backward reaches in the first micro-batch only (a data-dependent gate: an expert
    no token of the last micro-batch reaches): under hsdp their partial sum must still reach the replicas (it was
    reduce-scattered, never all-reduced: the step lost their gradients), and a param a unit uses on some
    micro-batches only must not shift the partial sum (`params`). Pipelines reducing each micro-batch (1F1B,
    interleaved, bf16; fsdp as well), and af.accumulate's, each equal one process; each pipeline unit is reduced
    once a micro-batch, all-reduced once a step (hsdp). `unfixed` (no zero-filled reduce-scatters) is refused
    after the schedule, naming the units, not applied. 4 then 2 processes over gloo (dp=2 replicas, fsdp=1)."""
    piped = ["hsdp", "hsdp:caller", "hsdp:params", "hsdp:interleaved", "hsdp:bf16:params", "hsdp:m=4:params",
             "fsdp:params", "fsdp:interleaved", "hsdp:unfixed"]  # fmt: skip
    proc = run_workers("pp_gated_worker.py", 4, "pp=2,dp=2,fsdp=1", *piped, timeout=300)
    assert proc.returncode == 0, output_of(proc)
    assert proc.stdout.count("GATED OK") == 4 * len(piped), output_of(proc)
    accumulated = ["hsdp", "hsdp:caller", "hsdp:params", "fsdp:params"]
    proc = run_workers("pp_gated_worker.py", 2, "dp=2,fsdp=1", *accumulated, timeout=300)
    assert proc.returncode == 0, output_of(proc)
    assert proc.stdout.count("GATED OK") == 2 * len(accumulated), output_of(proc)


@pytest.mark.slow
def test_kill_and_resume_on_pp2_x_dp2_is_bit_identical(tmp_path):
    proc = run_workers(
        "pp_train_worker.py", 4, "pp=2,dp=2", f"llama:ddp:resume={tmp_path / 'mid'}", timeout=300
    )
    assert proc.returncode == 0, output_of(proc)
    assert proc.stdout.count("PP OK") == 4, output_of(proc)


@pytest.mark.slow
def test_checkpoints_move_between_pp2_one_process_pp4_pp2_x_dp2_fsdp_and_fsdp2(tmp_path):
    """Saved on pp2, read whole by one process and by transformers, resumed on pp4 (which saves), then on
    pp2 x dp2 with fsdp (which saves: its sharded stages read whole again), and that on fsdp over 2 processes with
    no pipeline and on pp4: each run equal to one process going on from the same state. (One chain of 5
    launches, where two tests ran 8.)"""
    ck, back, ck2 = str(tmp_path / "pp2"), str(tmp_path / "pp4"), str(tmp_path / "pp2xdp2")
    hf, gpt2 = tmp_path / "pp2-hf", tmp_path / "gpt2-hf"
    proc = run_workers("pp_train_worker.py", 2, "pp=2", f"llama:save={ck}:pretrained={hf}", f"gpt2:pretrained={gpt2}",
                       timeout=300)  # fmt: skip
    assert proc.returncode == 0, output_of(proc)
    # one process reads the pipeline's checkpoint whole (every stage's params and optimizer state)
    plain = af.train_step(lm_loss, af.optim.adamw(1e-3, weight_decay=0.1), clip_grad_norm=0.5)
    whole = af.checkpoint.load(ck, like=plain.init(llama(4), seed=3))
    ref = af.checkpoint.load(ck + "-ref", like=plain.init(llama(4), seed=3))
    assert sorted(whole.params) == sorted(ref.params)
    for k in ref.params:
        torch.testing.assert_close(whole.params[k], ref.params[k], rtol=0, atol=2e-5)
    assert int(whole.step) == 3
    # its model files are the Hugging Face layout (an index over both stages' files): transformers reads them
    index = json.loads((tmp_path / "pp2" / "model.safetensors.index.json").read_text())
    assert {"model-rank00000.safetensors", "model-rank00001.safetensors"} == set(index["weight_map"].values())
    from transformers import LlamaForCausalLM

    llama(4).config.save_pretrained(ck)
    loaded, info = LlamaForCausalLM.from_pretrained(ck, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, whole.params[k])
    # save_pretrained on the stages writes the whole model (every stage's weights), as from one process
    loaded, info = LlamaForCausalLM.from_pretrained(hf, output_loading_info=True)
    assert not any(info.values()), info
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, whole.params[k], rtol=0, atol=0)
    from transformers import GPT2LMHeadModel

    loaded, info = GPT2LMHeadModel.from_pretrained(gpt2, output_loading_info=True)  # head tied across stages
    assert not any(info.values()), info
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    # it resumes on pp4 (exactly as one process goes on from the same state), whose checkpoint resumes on pp2 x dp2
    # with fsdp, whose sharded stages resume on fsdp over 2 processes (no pipeline) and on pp4 again
    # (the same pipeline degree resuming: test_kill_and_resume_on_pp2_x_dp2_is_bit_identical)
    runs = [(4, "pp=4", f"llama:load={ck}:save={back}"), (4, "pp=2,dp=2", f"llama:fsdp:load={back}:save={ck2}"),
            (2, "dp=2", f"llama:fsdp:load={ck2}"), (4, "pp=4", f"llama:load={ck2}")]  # fmt: skip
    for nproc, mesh, config in runs:
        proc = run_workers("pp_train_worker.py", nproc, mesh, config, timeout=300)
        assert proc.returncode == 0, output_of(proc)
        assert proc.stdout.count("PP OK") == nproc, output_of(proc)
        if config.endswith(
            f"save={ck2}"
        ):  # one process reads pp2 x dp2's sharded stages whole, and their state
            whole = af.checkpoint.load(ck2, like=plain.init(llama(4), seed=3))
            ref = af.checkpoint.load(ck2 + "-ref", like=plain.init(llama(4), seed=3))
            assert int(whole.step) == int(ref.step) == 9
            for (path, a), (_, b) in zip(af.tree.flatten_with_path(whole), af.tree.flatten_with_path(ref)):
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    torch.testing.assert_close(a, b, rtol=0, atol=2e-5, msg=lambda m, p=path: f"{p}: {m}")
