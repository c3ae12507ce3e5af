"""af.checkpoint: round trips, Hugging Face compatibility, exact resume, corruption, async saves, errors."""

import json
import os
import threading

import pytest
import torch

import accelfn as af
from accelfn.checkpoint import CheckpointError, CheckpointMismatchError, CorruptCheckpointError
from tests.models import MLP, lm_batches, tiny_gpt2, tiny_llama


def lm_loss(model, batch):
    logits = model(input_ids=batch["input_ids"]).logits
    return af.losses.cross_entropy(logits[:, :-1], batch["labels"][:, 1:])


def gpt2_state(seed=0, dropout=0.0, steps=2):
    torch.manual_seed(seed)
    step = af.train_step(lm_loss, af.optim.chain(af.optim.clip_by_global_norm(1.0), af.optim.adamw(1e-2)))
    state = step.init(tiny_gpt2(dropout=dropout), seed=seed)
    for b in lm_batches(steps, seed=seed):
        state, _ = step(state, b)
    return step, state


def snapshot(state):
    return af.tree.map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, state)


def assert_same(a, b):
    la, lb = af.tree.flatten_with_path(a), af.tree.flatten_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (p, x), (_, y) in zip(la, lb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, p
            assert torch.equal(x, y), p
        else:
            assert x == y, p


class Counter:
    """A stand-in for af.data.DataLoader: yields batch indices; state_dict() resumes mid-epoch."""

    def __init__(self, n):
        self.n, self.pos = n, 0

    def __iter__(self):
        while self.pos < self.n:
            self.pos += 1
            yield self.pos - 1

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, d):
        self.pos = d["pos"]


# ---- round trips ------------------------------------------------------------------------------------------
def test_round_trip_of_gpt2_state_with_chained_optimizer_and_odd_leaves(tmp_path):
    _, state = gpt2_state()
    base = torch.arange(24.0).reshape(4, 6)
    shared = torch.randn(3)
    state = state.replace(
        buffers={
            "mask": torch.tensor([True, False, True]),
            "count": torch.tensor([3, -1], dtype=torch.int64),
        },
        extra={
            "bf16": torch.randn(5, dtype=torch.bfloat16),
            "empty": torch.zeros(0, 7),
            "view": base.t()[1:4],
            "a": shared,
            "b": shared,
            "name": "run-1",
            "scale": 2.5,
            "flag": True,
            "n": 7,
        },  # fmt: skip
    )
    expected = snapshot(state)
    af.checkpoint.save(tmp_path / "ckpt", state)

    like = af.tree.map(lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else x, state)
    like = like.replace(extra={**like.extra, "name": "", "scale": 0.0, "flag": False, "n": 0})
    loaded = af.checkpoint.load(tmp_path / "ckpt", like=like)
    assert_same(loaded, expected)
    assert loaded.extra["a"] is loaded.extra["b"]  # shared stays shared
    assert "lm_head.weight" not in loaded.params  # tied weight: one tensor per params key
    assert type(loaded.opt_state[1]).__name__ == "AdamState"


def test_files_follow_the_hugging_face_layout_and_state_json_describes_them(tmp_path):
    _, state = gpt2_state()
    af.checkpoint.save(tmp_path / "c", state, max_shard_size="20KB")
    names = sorted(os.listdir(tmp_path / "c"))
    assert "model.safetensors.index.json" in names and "state.json" in names
    assert any(n.startswith("model-00001-of-") for n in names) and any(
        n.startswith("optimizer") for n in names
    )
    index = json.loads((tmp_path / "c" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state.params)
    meta = json.loads((tmp_path / "c" / "state.json").read_text())
    assert meta["step"] == 2 and meta["leaves"]["rng"]["data"] == state.rng.tolist()
    assert set(meta["files"]) == {n for n in names if n.endswith(".safetensors")}
    from safetensors.torch import load_file

    opt = load_file(
        str(tmp_path / "c" / meta["leaves"]["opt_state.1.mu.transformer.wte.weight"]["pieces"][0]["file"])
    )
    assert torch.equal(opt["1.mu.transformer.wte.weight"], state.opt_state[1].mu["transformer.wte.weight"])


def test_no_pickle_is_written(tmp_path):
    _, state = gpt2_state(steps=1)
    af.checkpoint.save(tmp_path / "c", state)
    for name in os.listdir(tmp_path / "c"):
        data = (tmp_path / "c" / name).read_bytes()
        assert not data.startswith(b"\x80") and b"PK\x03\x04" not in data[:4], name


# ---- Hugging Face ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make_model", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_transformers_loads_what_save_pretrained_wrote(tmp_path, make_model):
    from transformers import AutoModelForCausalLM

    model = make_model().eval()
    af.checkpoint.save_pretrained(tmp_path / "hf", model, max_shard_size="20KB")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)
    if make_model is tiny_gpt2:
        assert again.lm_head.weight is again.transformer.wte.weight


def test_save_pretrained_writes_what_transformers_save_pretrained_writes(tmp_path):
    # generation settings (a chat model's stop tokens), the class in `architectures`, the dtype of the weights
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = tiny_llama()
    model.generation_config = GenerationConfig(
        eos_token_id=[2, 7], temperature=0.6, do_sample=True, max_new_tokens=7
    )
    model = model.to(torch.bfloat16)  # cast after building: model.config still says float32
    assert model.config.architectures is None
    step = af.train_step(lm_loss, af.optim.sgd(0.0))
    state = step.init(model)
    af.checkpoint.save_pretrained(tmp_path / "af", state, model=step.model)
    assert (
        model.config.architectures is None and model.config.dtype != torch.bfloat16
    )  # the model's config is left as it was
    model.save_pretrained(tmp_path / "hf")  # the reference (it sets them on the model's config)
    assert sorted(os.listdir(tmp_path / "af")) == sorted(os.listdir(tmp_path / "hf"))
    ours, theirs = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("af", "hf"))
    assert ours == theirs and ours["architectures"] == ["LlamaForCausalLM"] and ours["dtype"] == "bfloat16", (
        ours
    )
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "af")
    assert again.dtype == torch.bfloat16
    g = again.generation_config
    assert (g.eos_token_id, g.temperature, g.do_sample, g.max_new_tokens) == ([2, 7], 0.6, True, 7)


def test_save_pretrained_from_a_train_state_is_loadable_by_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    step, state = gpt2_state()
    af.checkpoint.save_pretrained(tmp_path / "hf", state, config=step.model.config)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(again.transformer.wte.weight, state.params["transformer.wte.weight"])
    assert again.lm_head.weight is again.transformer.wte.weight


@pytest.mark.parametrize("make_model", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_save_pretrained_of_a_state_with_its_model_is_loaded_by_transformers_as_trained(tmp_path, make_model):
    # the replacement for Accelerate's save_model(model, dir) that docs/migration.md shows
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    step = af.autocast(af.train_step(lm_loss, af.optim.adamw(1e-2)), "bf16")
    state = step.init(make_model())
    for b in lm_batches(2):
        state, _ = step(state, b)
    af.checkpoint.save_pretrained(tmp_path / "hf", state, model=step.model)
    assert (tmp_path / "hf" / "config.json").exists()
    again, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), (
        info
    )  # no missing, unexpected or mismatched keys (Llama's inv_freq left out)
    for name, p in again.named_parameters():
        assert torch.equal(p, state.params[name]), name
    ids = torch.randint(0, 64, (2, 8))
    trained = step.model.eval()
    with torch.no_grad():
        assert torch.equal(trained(input_ids=ids).logits, again.eval()(input_ids=ids).logits)


def test_save_pretrained_of_a_state_with_its_model_writes_the_persistent_buffers(tmp_path):
    step = af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1))
    state = step.init(MLP(batchnorm=True))
    state, _ = step(state, torch.randn(8, 8))
    af.checkpoint.save_pretrained(tmp_path / "w", state, model=step.model)
    written = af.checkpoint.load_pretrained(tmp_path / "w")
    assert sorted(written) == sorted(MLP(batchnorm=True).state_dict())
    for name, t in written.items():
        assert torch.equal(t, {**state.params, **state.buffers}[name]), name
    assert not (tmp_path / "w" / "config.json").exists()  # a plain torch module has no config


def test_save_pretrained_of_a_state_alone_says_what_to_pass(tmp_path):
    step, state = gpt2_state(steps=0)
    with pytest.raises(TypeError, match=r"model=step\.model"):
        af.checkpoint.save_pretrained(tmp_path / "a", state)
    assert not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match="not the module this state trains"):
        af.checkpoint.save_pretrained(tmp_path / "b", state, model=tiny_llama())
    with pytest.raises(TypeError, match="model= goes with a TrainState"):
        af.checkpoint.save_pretrained(tmp_path / "c", step.model, model=step.model)
    af.checkpoint.save_pretrained(tmp_path / "d", state.params)  # the weights alone, on purpose
    assert sorted(os.listdir(tmp_path / "d")) == ["model.safetensors"]


def llama_of_hidden_size(hidden: int, tied: bool = False):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=tied,
    )  # fmt: skip
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_save_pretrained_refuses_a_model_of_other_shapes_than_the_state_before_writing(tmp_path, tied):
    # the bug: a state trained with hidden size 32, saved with model= a hidden-size-64 model (same names),
    # wrote config.json (64) beside 32-wide weights, which transformers then failed to load
    torch.manual_seed(0)
    step = af.train_step(lm_loss, af.optim.sgd(0.1))
    state = step.init(llama_of_hidden_size(32, tied))
    other = llama_of_hidden_size(64, tied)
    fresh, existing = tmp_path / "fresh", tmp_path / "existing"
    existing.mkdir()
    (existing / "tokenizer.json").write_text("{}")
    for folder in (fresh, existing):
        with pytest.raises(ValueError) as e:
            af.checkpoint.save_pretrained(folder, state, model=other)
        msg = str(e.value)
        assert "'model.embed_tokens.weight' has shape (64, 32) in the state but (64, 64) in model=" in msg, (
            msg
        )
        assert "not the module this state trains" in msg and "step.model" in msg, msg
    assert not fresh.exists()  # nothing written
    assert sorted(os.listdir(tmp_path)) == ["existing"] and os.listdir(existing) == ["tokenizer.json"]
    af.checkpoint.save_pretrained(
        fresh, state, model=step.model
    )  # its own model: tied or not, no false alarm
    assert json.loads((fresh / "config.json").read_text())["hidden_size"] == 32


def test_save_pretrained_keeps_the_other_files_of_a_model_folder(tmp_path):
    # Re-saving into a Hugging Face model folder replaces the weights, not the tokenizer or README beside them
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 64)
    folder = tmp_path / "model"
    af.checkpoint.save_pretrained(folder, net, config={"model_type": "toy"}, max_shard_size="10KB")
    assert (folder / "model.safetensors.index.json").exists()
    (folder / "tokenizer.json").write_text("{}")
    (folder / "README.md").write_text("# my model")
    (folder / "assets").mkdir()
    (folder / "assets" / "vocab.txt").write_text("a b c")
    with torch.no_grad():
        net.weight.add_(1.0)
    af.checkpoint.save_pretrained(folder, net, config={"model_type": "toy"})  # one file now: old shards go
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md", "assets", "config.json", "model.safetensors", "tokenizer.json"]  # fmt: skip
    assert (folder / "README.md").read_text() == "# my model" and (folder / "assets" / "vocab.txt").exists()
    loaded = af.checkpoint.load_pretrained(folder, like=dict(torch.nn.Linear(64, 64).named_parameters()))
    assert torch.equal(loaded["weight"], net.weight)


def test_load_pretrained_reads_a_sharded_checkpoint_written_by_transformers(tmp_path):
    ref = tiny_llama()
    ref.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    step = af.train_step(lm_loss, af.optim.adamw(1e-3))
    state = step.init(tiny_llama())
    params = af.checkpoint.load_pretrained(tmp_path / "hf", like=state.params)
    for name, p in ref.named_parameters():
        assert torch.equal(params[name], p), name
    assert params["model.embed_tokens.weight"] is state.params["model.embed_tokens.weight"]  # in place


def _pretrained_weights(tmp_path):
    torch.manual_seed(0)
    weights = {k: v.detach().clone() for k, v in MLP().state_dict().items()}  # fc1.*, fc2.*
    af.checkpoint.save_pretrained(tmp_path / "hf", {**weights, "stray.weight": torch.ones(3)})
    return tmp_path / "hf", weights


def test_load_pretrained_names_missing_weights_even_when_not_strict(tmp_path):
    path, weights = _pretrained_weights(tmp_path)
    like = {**{k: torch.zeros_like(v) for k, v in weights.items()}, "fc3.weight": torch.zeros(2, 2)}
    for strict in (True, False):
        with pytest.raises(CheckpointMismatchError, match=r"missing \['fc3.weight'\]"):
            af.checkpoint.load_pretrained(path, like=like, strict=strict)


def test_load_pretrained_refuses_unexpected_weights_unless_not_strict(tmp_path):
    path, weights = _pretrained_weights(tmp_path)
    like = {k: torch.zeros_like(v) for k, v in weights.items()}
    with pytest.raises(CheckpointMismatchError, match=r"unexpected \['stray.weight'\].*strict=False"):
        af.checkpoint.load_pretrained(path, like=like)
    assert all(not v.any() for v in like.values())  # nothing was loaded
    loaded = af.checkpoint.load_pretrained(path, like=like, strict=False)
    assert loaded.keys() == weights.keys()  # the stray weight is skipped, the rest loaded in place
    for k, v in weights.items():
        assert loaded[k] is like[k] and torch.equal(loaded[k], v), k


# ---- exact resume ---------------------------------------------------------------------------------------------
def test_resume_is_bitwise_identical_to_an_uninterrupted_run(tmp_path):
    batches = lm_batches(6, seed=1)

    def run(stop_after=None, resume=None):
        step = af.train_step(lm_loss, af.optim.chain(af.optim.clip_by_global_norm(1.0), af.optim.adamw(1e-2)))
        torch.manual_seed(123 if resume else 0)  # a resumed run starts from different weights
        state = step.init(tiny_gpt2(dropout=0.1), seed=0)
        loader = Counter(len(batches))
        if resume:
            state = step.init(af.checkpoint.load(resume, like=state, loader=loader))
        losses = []
        for i in loader:
            state, m = step(state, batches[i])
            losses.append(m["loss"].item())
            if stop_after is not None and loader.pos == stop_after:
                af.checkpoint.save(tmp_path / "ckpt", state, loader=loader)
                return state, losses
        return state, losses

    full, full_losses = run()
    _, first = run(stop_after=3)
    resumed, rest = run(resume=tmp_path / "ckpt")
    assert first + rest == full_losses
    assert_same(resumed, full)


# ---- latest, keep_last, atomic replace ------------------------------------------------------------------------
def test_latest_and_keep_last(tmp_path):
    state = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)).init(torch.nn.Linear(2, 2))
    assert af.checkpoint.latest(tmp_path) is None
    with pytest.raises(
        FileNotFoundError, match="latest\\(root\\) returns None when root holds no committed checkpoint"
    ):
        af.checkpoint.load(
            af.checkpoint.latest(tmp_path),
            like=af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)).init(torch.nn.Linear(2, 1)),
        )
    for s in [1, 2, 10, 3]:
        af.checkpoint.save(tmp_path / f"step-{s}", state.replace(step=torch.tensor(s)), keep_last=3)
    (tmp_path / ".tmp-step-99-abc").mkdir()  # an interrupted save
    (tmp_path / "step-50").mkdir()  # no state.json: not committed
    assert af.checkpoint.latest(tmp_path) == str(tmp_path / "step-10")
    assert sorted(p.name for p in af.checkpoint.checkpoints(tmp_path)) == ["step-10", "step-2", "step-3"]


def test_keep_last_only_deletes_checkpoints_of_the_same_series(tmp_path):
    state = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)).init(torch.nn.Linear(2, 2))
    at = lambda s: state.replace(step=torch.tensor(s))  # noqa: E731
    af.checkpoint.save(tmp_path / "best", at(2))  # the user's own checkpoints beside the series
    af.checkpoint.save(tmp_path / "final", at(1))
    af.checkpoint.save(tmp_path / "run2-step-1", at(1))
    for s in [1, 2, 3]:  # another series, with zero-padded steps
        af.checkpoint.save(tmp_path / f"ckpt-{s:06d}", at(s))
    for s in [1, 2, 3, 4, 5]:
        af.checkpoint.save(tmp_path / f"step-{s}", at(s), keep_last=2)
    names = sorted(p.name for p in af.checkpoint.checkpoints(tmp_path))
    assert names == [
        "best",
        "ckpt-000001",
        "ckpt-000002",
        "ckpt-000003",
        "final",
        "run2-step-1",
        "step-4",
        "step-5",
    ]
    af.checkpoint.save(tmp_path / "ckpt-000004", at(4), keep_last=1)  # the zero-padded series prunes itself
    names = sorted(p.name for p in af.checkpoint.checkpoints(tmp_path))
    assert names == ["best", "ckpt-000004", "final", "run2-step-1", "step-4", "step-5"]
    with pytest.warns(UserWarning, match="does not end in a step number"):  # no series: nothing is deleted
        af.checkpoint.save(tmp_path / "last", at(6), keep_last=1)
    assert len(af.checkpoint.checkpoints(tmp_path)) == 7


def test_keep_last_with_async_saves_keeps_a_best_checkpoint(tmp_path):
    state = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)).init(torch.nn.Linear(2, 2))
    af.checkpoint.save(tmp_path / "best", state.replace(step=torch.tensor(0)))
    for s in [1, 2, 3]:
        af.checkpoint.save(
            tmp_path / f"step_{s}", state.replace(step=torch.tensor(s)), keep_last=1, async_save=True
        )
    af.checkpoint.wait()
    assert sorted(p.name for p in af.checkpoint.checkpoints(tmp_path)) == ["best", "step_3"]


def test_saving_over_an_existing_checkpoint_replaces_it(tmp_path):
    state = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)).init(torch.nn.Linear(2, 2))
    af.checkpoint.save(tmp_path / "c", state)
    newer = state.replace(step=torch.tensor(5), params={k: v + 1 for k, v in state.params.items()})
    af.checkpoint.save(tmp_path / "c", newer)
    assert sorted(os.listdir(tmp_path)) == ["c"]
    loaded = af.checkpoint.load(tmp_path / "c", like=snapshot(state))
    assert int(loaded.step) == 5 and torch.equal(loaded.params["weight"], newer.params["weight"])


# ---- corruption and errors -----------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path):
    _, state = gpt2_state(steps=1)
    af.checkpoint.save(tmp_path / "c", state, max_shard_size="20KB")
    return tmp_path / "c", state


def test_a_flipped_byte_is_detected_and_the_file_named(saved):
    path, state = saved
    victim = path / "model-00002-of-00007.safetensors"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="model-00002-of-00007.safetensors.*CRC-32"):
        af.checkpoint.load(path, like=state)


@pytest.mark.parametrize("where", ["first", "middle", "last", "skipped"])
def test_large_files_are_checked_while_reading_on_a_second_thread(tmp_path, where):
    # Files >= 32 MiB are checksummed on a helper thread, overlapped with reading: check it agrees with
    # zlib on a whole file, finds a flipped byte anywhere (also in a tensor that `names` skips), and reads
    # straight into `into` tensors.
    import zlib

    from accelfn.checkpoint import io

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(6 << 20, generator=g), "b": torch.randn(3 << 20, generator=g),
               "c": torch.arange(5, dtype=torch.int64)}  # fmt: skip
    path = tmp_path / "big.safetensors"
    record = io.write_file(path, tensors)
    data = bytearray(path.read_bytes())
    assert record.size == len(data) >= io._OVERLAP_MIN and record.crc32 == zlib.crc32(data)
    into = {"a": torch.empty(6 << 20)}
    out = io.read_file(path, record, into=into)
    assert out["a"] is into["a"] and all(torch.equal(out[k], tensors[k]) for k in tensors)
    assert set(io.read_file(path, record, names={"c"})) == {"c"}

    _, start = io.read_header(path)
    header = json.loads(bytes(data[8:start]))
    offset = {"first": 0, "middle": header["a"]["data_offsets"][1] + 12345,
              "last": len(data) - start - 1, "skipped": header["a"]["data_offsets"][0] + (5 << 20)}[where]  # fmt: skip
    data[start + offset] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="big.safetensors.*CRC-32"):
        io.read_file(path, record, names={"c"} if where == "skipped" else None)


def test_a_truncated_file_is_detected_and_named(saved):
    path, state = saved
    victim = path / "optimizer-00003-of-00014.safetensors"
    victim.write_bytes(victim.read_bytes()[:-100])
    with pytest.raises(CorruptCheckpointError, match="optimizer-00003-of-00014.safetensors.*truncated"):
        af.checkpoint.load(path, like=state)


def test_a_missing_folder_is_a_file_not_found_error(tmp_path):
    _, state = gpt2_state(steps=0)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        af.checkpoint.load(tmp_path / "nope", like=state)


def test_shape_dtype_and_structure_mismatches_name_the_path(saved):
    path, state = saved
    p = dict(state.params)
    p["transformer.wpe.weight"] = torch.zeros(7, 32)
    with pytest.raises(
        CheckpointMismatchError, match=r"'params.transformer.wpe.weight'.*\(32, 32\).*\(7, 32\)"
    ):
        af.checkpoint.load(path, like=state.replace(params=p))
    p = dict(state.params)
    p["transformer.wpe.weight"] = p["transformer.wpe.weight"].double()
    with pytest.raises(CheckpointMismatchError, match="'params.transformer.wpe.weight'.*float32.*float64"):
        af.checkpoint.load(path, like=state.replace(params=p))
    with pytest.raises(
        CheckpointMismatchError, match="in the checkpoint but not in `like`: \\['opt_state.1.count'"
    ):
        af.checkpoint.load(path, like=state.replace(opt_state=state.opt_state[:1]))
    extra = {**state.extra, "ema": torch.zeros(3)}
    with pytest.raises(
        CheckpointMismatchError, match="in `like` but not in the checkpoint: \\['extra.ema'\\]"
    ):
        af.checkpoint.load(path, like=state.replace(extra=extra))


def test_a_loader_position_cannot_be_restored_from_a_checkpoint_saved_without_one(saved):
    path, state = saved
    loader = Counter(10)
    loader.pos = 4
    with pytest.raises(CheckpointError, match="no loader position.*saved without loader="):
        af.checkpoint.load(path, like=state, loader=loader)
    assert loader.pos == 4


def test_non_json_leaves_are_refused_at_save(tmp_path):
    state = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)).init(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="'extra.fn' is a function"):
        af.checkpoint.save(tmp_path / "c", state.replace(extra={"fn": lambda: 0}))
    with pytest.raises(TypeError, match="argument 'state'"):
        af.checkpoint.save(tmp_path / "c", {"w": torch.ones(1)})


# ---- async ---------------------------------------------------------------------------------------------------
def test_async_save_lets_training_continue_and_equals_a_synchronous_save(tmp_path, monkeypatch):
    step, state = gpt2_state()
    af.checkpoint.save(tmp_path / "sync", state)
    expected = snapshot(state)
    gate = threading.Event()
    write_file = af.checkpoint.io.write_file

    def slow_write(*a, **k):
        assert gate.wait(30)
        return write_file(*a, **k)

    monkeypatch.setattr(af.checkpoint.io, "write_file", slow_write)
    handle = af.checkpoint.save(tmp_path / "async", state, async_save=True)
    for b in lm_batches(2, seed=5):  # training goes on (and updates the params in place) during the write
        state, _ = step(state, b)
    assert not handle.done() and not (tmp_path / "async").exists()
    gate.set()
    assert handle.result() == str(tmp_path / "async")
    fresh = gpt2_state(seed=3, steps=0)[1]
    assert_same(af.checkpoint.load(tmp_path / "async", like=fresh), expected)
    a = json.loads((tmp_path / "sync" / "state.json").read_text())
    b = json.loads((tmp_path / "async" / "state.json").read_text())
    assert a["files"] == b["files"] and a["leaves"] == b["leaves"]  # byte-identical files


def test_an_error_in_the_background_write_is_raised_by_wait(tmp_path, monkeypatch):
    state = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)).init(torch.nn.Linear(2, 2))

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(af.checkpoint.io, "write_file", broken)
    af.checkpoint.save(tmp_path / "c", state, async_save=True)
    with pytest.raises(OSError, match="disk full"):
        af.checkpoint.wait()
    assert (
        af.checkpoint.latest(tmp_path) is None and os.listdir(tmp_path) == []
    )  # the temporary folder is gone


def _staged():
    from accelfn.checkpoint import async_

    return dict(async_._staging)  # the host copies async saves keep (what clear_staging frees)


def _same_files(a, b):
    ja, jb = (json.loads((p / "state.json").read_text()) for p in (a, b))
    return ja["files"] == jb["files"] and ja["leaves"] == jb["leaves"]  # sizes + CRC-32 of every file


def test_clear_staging_frees_the_async_buffers_and_a_later_async_save_equals_a_sync_save(tmp_path):
    import gc
    import weakref

    step, state = gpt2_state()
    af.checkpoint.clear_staging()  # whatever earlier tests staged
    assert _staged() == {}
    af.checkpoint.save(tmp_path / "a1", state, async_save=True).result()
    first = _staged()
    fields = ("params.", "buffers.", "opt_state.", "extra.")
    tensors = {p: v for p, v in af.tree.flatten_with_path(state) if p.startswith(fields)}
    tensors = {p: v for p, v in tensors.items() if isinstance(v, torch.Tensor)}
    assert set(first) == set(tensors), set(first) ^ set(tensors)  # one host copy per tensor leaf
    for p, buf in first.items():
        assert torch.equal(buf, tensors[p]) and buf.data_ptr() != tensors[p].data_ptr(), p

    state, _ = step(state, next(iter(lm_batches(1, seed=9))))
    af.checkpoint.save(tmp_path / "a2", state, async_save=True).result()
    assert all(_staged()[p] is buf for p, buf in first.items()), "kept and reused by the next async save"

    refs = [weakref.ref(buf) for buf in first.values()]
    del first, buf
    af.checkpoint.clear_staging()
    gc.collect()
    assert _staged() == {} and not [r for r in refs if r() is not None], "the buffers are freed"

    state, _ = step(state, next(iter(lm_batches(1, seed=10))))
    expected = snapshot(state)
    af.checkpoint.save(tmp_path / "sync", state)
    af.checkpoint.save(tmp_path / "a3", state, async_save=True).result()  # new buffers, same checkpoint
    assert _same_files(tmp_path / "sync", tmp_path / "a3")
    assert_same(af.checkpoint.load(tmp_path / "a3", like=gpt2_state(seed=3, steps=0)[1]), expected)
    af.checkpoint.clear_staging()


def test_clear_staging_waits_for_the_save_in_flight_before_freeing_its_buffers(tmp_path, monkeypatch):
    _, state = gpt2_state()
    af.checkpoint.save(tmp_path / "sync", state)
    gate = threading.Event()
    write_file = af.checkpoint.io.write_file

    def slow_write(*a, **k):
        assert gate.wait(30)
        return write_file(*a, **k)

    monkeypatch.setattr(af.checkpoint.io, "write_file", slow_write)
    handle = af.checkpoint.save(tmp_path / "async", state, async_save=True)
    clearing = threading.Thread(target=af.checkpoint.clear_staging)
    clearing.start()
    clearing.join(0.5)
    assert clearing.is_alive() and not handle.done() and _staged(), "clear_staging returned mid-write"
    gate.set()
    clearing.join(30)
    assert not clearing.is_alive() and handle.done() and _staged() == {}
    assert handle.result() == str(tmp_path / "async") and _same_files(tmp_path / "sync", tmp_path / "async")


def test_mlp_with_batchnorm_buffers_round_trips(tmp_path):
    step = af.train_step(lambda m, b: af.losses.mse(m(b["x"]), b["y"]), af.optim.sgd(0.1, momentum=0.9))
    state = step.init(MLP(batchnorm=True))
    state, _ = step(state, {"x": torch.randn(8, 8), "y": torch.randn(8, 4)})
    expected = snapshot(state)
    af.checkpoint.save(tmp_path / "c", state)
    loaded = af.checkpoint.load(tmp_path / "c", like=step.init(MLP(batchnorm=True)))
    assert_same(loaded, expected)


def test_save_refuses_to_replace_a_folder_that_is_not_a_checkpoint(tmp_path):
    state = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)).init(torch.nn.Linear(2, 2))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="is not a checkpoint"):
        af.checkpoint.save(tmp_path / "data", state)
    assert (tmp_path / "data" / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    "name", ["__init__", "format", "io", "atomic", "leaves", "save", "load", "pretrained", "async_"]
)
def test_docstring_examples_run(name):
    import doctest
    import importlib

    module = importlib.import_module(
        f"accelfn.checkpoint.{name}" if name != "__init__" else "accelfn.checkpoint"
    )
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0, name


# ---- from_pretrained of every layout save_pretrained writes: no missing, unexpected or mismatched key ----------
def tied_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def trained_state(model, steps=2):
    step = af.train_step(lm_loss, af.optim.adamw(1e-2))
    state = step.init(model)
    for b in lm_batches(steps):
        state, _ = step(state, b)
    return step, state


def full_values(state, model):
    """Our values under every name of `model`'s state_dict (tied names included, DTensors gathered)."""
    values = {**model.state_dict(), **state.params, **state.buffers}
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in values.items()}


def _layout(kind, tmp_path):
    """Write one layout into tmp_path / "out"; returns the values that folder must load as."""
    out = tmp_path / "out"
    if kind in ("llama", "gpt2-tied", "llama-tied", "llama-sharded-files"):
        model = {"llama": tiny_llama, "gpt2-tied": tiny_gpt2, "llama-tied": tied_llama}.get(
            kind, tiny_llama
        )()
        size = "20KB" if kind == "llama-sharded-files" else "5GB"
        af.checkpoint.save_pretrained(out, model, max_shard_size=size)
        return model.state_dict()
    if kind in ("state", "state-tied"):
        step, state = trained_state(tiny_llama() if kind == "state" else tied_llama())
        af.checkpoint.save_pretrained(out, state, model=step.model)
        return full_values(state, step.model)
    if kind == "params-and-config":  # a dict with a config naming its class
        step, state = trained_state(tiny_gpt2())
        config = step.model.config
        config.architectures = ["GPT2LMHeadModel"]
        af.checkpoint.save_pretrained(out, state.params, config=config, max_shard_size="30KB")
        return full_values(state, step.model)
    if kind == "fsdp-state":  # DTensor params on a one-process mesh, gathered on save
        with af.Mesh({"dp": -1}, device="cpu"):
            step = af.shard(af.train_step(lm_loss, af.optim.adamw(1e-2)), af.Mesh.current(), strategy="fsdp")
            state = step.init(tied_llama())
            for b in lm_batches(2):
                state, _ = step(state, b)
            assert any(hasattr(p, "full_tensor") for p in state.params.values())
            af.checkpoint.save_pretrained(out, state, model=step.model, max_shard_size="20KB")
            return full_values(state, step.model)
    raise AssertionError(kind)


LAYOUTS = ["llama", "gpt2-tied", "llama-tied", "llama-sharded-files", "state", "state-tied", "params-and-config",
           "fsdp-state"]  # fmt: skip


@pytest.mark.filterwarnings("ignore:Model (has|with) `tie_word_embeddings=True`:UserWarning")
@pytest.mark.parametrize("kind", LAYOUTS)
def test_every_layout_save_pretrained_writes_loads_in_transformers_with_no_missing_keys(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    values = _layout(kind, tmp_path)
    if kind in ("llama-sharded-files", "params-and-config", "fsdp-state"):
        assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info  # missing_keys, unexpected_keys, mismatched_keys, error_msgs
    state_dict = loaded.state_dict()
    assert set(state_dict) <= set(values)
    for name, t in state_dict.items():
        assert torch.equal(t, values[name].detach()), name


def test_save_pretrained_refuses_weights_that_from_pretrained_would_leave_random(tmp_path):
    _, state = gpt2_state(steps=0)
    config = tiny_gpt2().config
    config.architectures = ["GPT2LMHeadModel"]
    params = {k: v for k, v in state.params.items() if k != "transformer.h.1.mlp.c_fc.weight"}
    with pytest.raises(
        ValueError, match=r"GPT2LMHeadModel .*missing 1: \['transformer.h.1.mlp.c_fc.weight'\]"
    ):
        af.checkpoint.save_pretrained(tmp_path / "a", params, config=config)
    renamed = {f"net.{k}": v for k, v in state.params.items()}
    with pytest.raises(ValueError, match=r"unexpected \d+: \['net\.transformer"):
        af.checkpoint.save_pretrained(tmp_path / "b", renamed, config=config)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    af.checkpoint.save_pretrained(tmp_path / "c", renamed)  # no config: the weights alone, no check


def test_save_pretrained_takes_a_base_model_s_names_as_transformers_does(tmp_path):
    # transformers loads GPT2Model's names (no "transformer." prefix) into a GPT2LMHeadModel: not an error here
    from transformers import AutoModelForCausalLM

    model = tiny_gpt2()
    config = model.config
    config.architectures = ["GPT2LMHeadModel"]
    bare = model.transformer.state_dict()
    af.checkpoint.save_pretrained(tmp_path / "bare", bare, config=config)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path / "bare", output_loading_info=True)
    assert not any(info.values()), info
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_save_pretrained_of_a_wrapper_around_a_transformers_model_names_the_keys(tmp_path):
    # torch.compile(model), or a module holding a transformers model and its config: the names carry the
    # wrapper's prefix, which from_pretrained would not find (a random model); refused, naming the way out
    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

    for wrapped, prefix in ((torch.compile(tiny_llama()), "_orig_mod"), (Wrapper(tiny_llama()), "inner")):
        with pytest.raises(
            ValueError, match=rf"LlamaForCausalLM at '{prefix}'.*removeprefix\('{prefix}.'\)"
        ) as e:
            af.checkpoint.save_pretrained(tmp_path / prefix, wrapped)
        assert f"'{prefix}.model.embed_tokens.weight'" in str(e.value) and not (tmp_path / prefix).exists()


def test_a_loader_that_cannot_resume_is_refused_before_any_weight_is_written(tmp_path):
    # the loader's checks run first: a load that raises on them leaves `like` (and its bound module) untouched
    step = af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1))
    torch.manual_seed(0)
    state = step.init(torch.nn.Linear(2, 2))
    saved_loader = af.data.DataLoader(torch.arange(16.0).reshape(8, 2), batch_size=4)
    for batch in saved_loader:
        state, _ = step(state, batch)
        break
    af.checkpoint.save(tmp_path / "c", state, loader=saved_loader)
    torch.manual_seed(1)
    other = af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1)).init(torch.nn.Linear(2, 2))
    before = {k: v.clone() for k, v in other.params.items()}
    wrong = af.data.DataLoader(torch.arange(16.0).reshape(8, 2), batch_size=8)
    with pytest.raises(ValueError, match="global_batch_size=4 but this loader has global_batch_size=8"):
        af.checkpoint.load(tmp_path / "c", like=other, loader=wrong)
    assert all(torch.equal(other.params[k], before[k]) for k in before)  # the same tensors, not written
    right = af.data.DataLoader(torch.arange(16.0).reshape(8, 2), batch_size=4)
    loaded = af.checkpoint.load(tmp_path / "c", like=other, loader=right)
    assert all(torch.equal(loaded.params[k], state.params[k]) for k in before)
    assert [b.tolist() for b in right] == [[[8.0, 9.0], [10.0, 11.0], [12.0, 13.0], [14.0, 15.0]]]
