"""af.train_step / af.eval_step against plain PyTorch loops."""

import copy

import pytest
import torch

import accelfn as af
from tests.models import MLP, lm_batches, tiny_bert, tiny_gpt2, tiny_llama


def lm_loss(model, batch):
    logits = model(input_ids=batch["input_ids"]).logits
    return af.losses.cross_entropy(logits[:, :-1], batch["labels"][:, 1:])


def plain_lm_loss(model, batch):
    logits = model(input_ids=batch["input_ids"]).logits
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1), ignore_index=-100
    )


def max_param_diff(params: dict, module: torch.nn.Module) -> float:
    ref = dict(module.named_parameters())
    assert params.keys() == ref.keys()
    return max((params[k].detach() - ref[k].detach()).abs().max().item() for k in ref)


@pytest.mark.parametrize("make_model", [tiny_gpt2, tiny_llama], ids=["gpt2", "llama"])
def test_train_step_matches_plain_loop_on_causal_lm(make_model):
    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model)
    batches = lm_batches(20)

    step = af.train_step(lm_loss, af.optim.adamw(1e-3, weight_decay=0.01))
    state = step.init(model)
    ours = []
    for b in batches:
        state, metrics = step(state, b)
        ours.append(metrics["loss"].item())

    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01)
    theirs = []
    for b in batches:
        loss = plain_lm_loss(ref, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        theirs.append(loss.item())

    assert ours == pytest.approx(theirs, abs=1e-5)
    assert max_param_diff(state.params, ref) <= 1e-5
    assert int(state.step) == 20


def test_tied_embeddings_stay_tied_and_are_stored_once():
    model = tiny_gpt2()
    step = af.train_step(lm_loss, af.optim.adamw(1e-2))
    state = step.init(model)
    assert "lm_head.weight" not in state.params and "transformer.wte.weight" in state.params
    before = state.params["transformer.wte.weight"].detach().clone()
    for b in lm_batches(3):
        state, _ = step(state, b)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.weight is state.params["transformer.wte.weight"]
    assert not torch.equal(before, state.params["transformer.wte.weight"])


def test_bert_masked_lm_trains_like_plain_loop():
    model = tiny_bert()
    ref = copy.deepcopy(model)
    batches = lm_batches(5)

    def loss_fn(m, b):
        return af.losses.cross_entropy(m(input_ids=b["input_ids"]).logits, b["labels"])

    step = af.train_step(loss_fn, af.optim.adam(1e-3))
    state = step.init(model)
    for b in batches:
        state, _ = step(state, b)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    for b in batches:
        logits = ref(input_ids=b["input_ids"]).logits
        torch.nn.functional.cross_entropy(logits.reshape(-1, 64), b["labels"].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    assert max_param_diff(state.params, ref) <= 1e-5


def test_batchnorm_running_stats_come_back_in_state():
    model = MLP(batchnorm=True)
    ref = copy.deepcopy(model)
    xs = [torch.randn(16, 8) for _ in range(5)]
    ys = [torch.randn(16, 4) for _ in range(5)]

    step = af.train_step(lambda m, b: af.losses.mse(m(b[0]), b[1]).mean(), af.optim.sgd(0.1, momentum=0.9))
    state = step.init(model)
    first_mean = state.buffers["norm.running_mean"]
    for x, y in zip(xs, ys):
        state, _ = step(state, (x, y))

    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, y in zip(xs, ys):
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    for name, buf in ref.named_buffers():
        assert torch.allclose(state.buffers[name], buf, atol=1e-6), name
    assert int(state.buffers["norm.num_batches_tracked"]) == 5
    assert not torch.equal(first_mean, torch.zeros(16))  # running stats moved (updated in place)
    assert max_param_diff(state.params, ref) <= 1e-5


def test_dropout_is_reproducible_from_the_state_key():
    batch = {"x": torch.randn(32, 8), "y": torch.randn(32, 4)}

    def loss_fn(m, b):
        return af.losses.mse(m(b["x"]), b["y"])

    def first_loss(seed, donate=True):
        torch.manual_seed(123)
        model = MLP(dropout=0.5)
        step = af.train_step(loss_fn, af.optim.sgd(0.1), donate=donate)
        state = step.init(model, seed=seed)
        return step, state

    step, state = first_loss(0, donate=False)
    _, m1 = step(state, batch)
    torch.rand(10)  # disturbing the global RNG must not matter
    _, m2 = step(state, batch)
    assert m1["loss"].item() == m2["loss"].item()

    step_b, state_b = first_loss(1, donate=False)
    _, m3 = step_b(state_b, batch)
    assert m3["loss"].item() != m1["loss"].item()


def test_dropout_masks_differ_between_steps_and_leave_global_rng_alone():
    model = MLP(dropout=0.5)
    step = af.train_step(lambda m, b: af.losses.mse(m(b), torch.zeros(32, 4)), af.optim.sgd(0.0))
    state = step.init(model, seed=0)
    x = torch.randn(32, 8)
    torch.manual_seed(7)
    expected_next = torch.rand(3)
    torch.manual_seed(7)
    state, m1 = step(state, x)
    state, m2 = step(state, x)
    assert m1["loss"].item() != m2["loss"].item()  # lr=0: params equal, only the mask changed
    assert torch.equal(torch.rand(3), expected_next)


def test_donate_false_keeps_the_input_state_valid():
    model = MLP()
    step = af.train_step(
        lambda m, b: af.losses.mse(m(b), torch.zeros(4, 4)), af.optim.adamw(0.1), donate=False
    )
    state = step.init(model)
    snapshot = {k: v.detach().clone() for k, v in state.params.items()}
    new_state, _ = step(state, torch.randn(4, 8))
    for k, v in state.params.items():
        assert torch.equal(v, snapshot[k])
        assert not torch.equal(new_state.params[k], snapshot[k])


def test_frozen_parameters_are_not_updated():
    model = MLP()
    model.fc1.weight.requires_grad_(False)
    step = af.train_step(lambda m, b: af.losses.mse(m(b), torch.ones(4, 4)), af.optim.adamw(0.1))
    state = step.init(model)
    frozen = state.params["fc1.weight"].detach().clone()
    state, _ = step(state, torch.randn(4, 8))
    assert torch.equal(state.params["fc1.weight"], frozen)
    assert "fc1.weight" not in state.opt_state.mu


def test_clip_grad_norm_matches_torch_and_reports_norm():
    model = MLP()
    ref = copy.deepcopy(model)
    x, y = torch.randn(16, 8) * 10, torch.randn(16, 4)
    step = af.train_step(lambda m, b: af.losses.mse(m(b[0]), b[1]), af.optim.sgd(0.1), clip_grad_norm=0.5)
    state = step.init(model)
    state, metrics = step(state, (x, y))
    loss = torch.nn.functional.mse_loss(ref(x), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert metrics["grad_norm"].item() == pytest.approx(norm.item(), rel=1e-6)
    assert max_param_diff(state.params, ref) <= 1e-6


def test_metrics_hold_loss_lr_and_aux_as_tensors():
    model = MLP()
    sched = af.optim.linear(0.1, 0.0, 10)

    def loss_fn(m, b):
        out = m(b)
        return out.pow(2).mean(), {"out_mean": out.mean()}

    step = af.train_step(loss_fn, af.optim.sgd(sched))
    state = step.init(model)
    state, m1 = step(state, torch.randn(4, 8))
    state, m2 = step(state, torch.randn(4, 8))
    assert set(m2) == {"loss", "lr", "out_mean"}
    assert all(isinstance(v, torch.Tensor) for v in m2.values())
    assert m1["lr"].item() == pytest.approx(0.1) and m2["lr"].item() == pytest.approx(0.09)


def test_eval_step_runs_in_eval_mode_without_grad():
    model = MLP(batchnorm=True, dropout=0.5)
    seen = {}

    def fn(m, b):
        seen["training"] = m.training
        return m(b)

    train = af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1))
    state = train.init(model)
    evaluate = af.eval_step(fn)
    evaluate.init(model)
    x = torch.randn(4, 8)
    out = evaluate(state, x)
    assert seen["training"] is False and not out.requires_grad
    assert torch.equal(out, evaluate(state, x))  # deterministic: no dropout in eval mode
    assert model.training  # mode restored


def test_eval_step_uses_the_states_params_and_buffers_like_an_eval_mode_copy():
    """The eval step's module is a different object from the training one, so it only gives the trained
    output if it really binds `state.params` and `state.buffers` (BatchNorm running stats)."""
    torch.manual_seed(0)
    original = MLP(batchnorm=True, dropout=0.5)
    untrained = copy.deepcopy(original)
    train = af.train_step(lambda m, b: af.losses.mse(m(b[0]), b[1]), af.optim.adamw(0.05))
    state = train.init(copy.deepcopy(original))
    for _ in range(4):
        state, _ = train(state, (torch.randn(16, 8), torch.randn(16, 4)))
    assert not torch.equal(state.params["fc1.weight"], original.fc1.weight)
    assert not torch.equal(state.buffers["norm.running_mean"], original.norm.running_mean)

    eval_module = copy.deepcopy(original)
    evaluate = af.eval_step(lambda m, b: m(b))
    evaluate.init(eval_module)
    x = torch.randn(8, 8)
    out = evaluate(state, x)

    ref = copy.deepcopy(original)
    ref.load_state_dict({**state.params, **state.buffers})
    ref.eval()
    with torch.no_grad():
        expected = ref(x)
        before = untrained.eval()(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert not torch.allclose(out, before, atol=1e-3)  # the trained weights, not the untrained module's
    assert torch.equal(evaluate(state, x), out)  # dropout off: deterministic


def test_loaded_state_with_plain_tensors_binds_to_the_model():
    model = MLP()
    step = af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1))
    state = step.init(model)
    copied = af.tree.map(lambda t: t.detach().clone(), state)
    fresh = step.init(copied)
    x = torch.randn(4, 8)
    fresh, _ = step(fresh, x)
    assert model.fc1.weight is fresh.params["fc1.weight"]
    assert isinstance(fresh.params["fc1.weight"], torch.nn.Parameter)


def test_train_state_is_a_pytree_in_optree_and_torch():
    import torch.utils._pytree as tp

    model = MLP()
    state = af.train_step(lambda m, b: m(b).sum(), af.optim.adamw(1e-3)).init(model)
    paths = [p for p, _ in af.tree.flatten_with_path(state)]
    assert (
        "params.fc1.weight" in paths
        and "opt_state.mu.fc1.weight" in paths
        and "opt_state.count" in paths
        and "rng" in paths
    )
    leaves, spec = tp.tree_flatten(state)
    again = tp.tree_unflatten(leaves, spec)
    assert isinstance(again, af.TrainState) and again.params.keys() == state.params.keys()


# ---- bad input ------------------------------------------------------------------------------------------------
def test_non_scalar_loss_is_a_clear_error():
    step = af.train_step(lambda m, b: m(b), af.optim.sgd(0.1))
    state = step.init(MLP())
    with pytest.raises(ValueError, match=r"shape \(4, 4\).*scalar"):
        step(state, torch.randn(4, 8))


def test_loss_of_wrong_type_is_a_clear_error():
    step = af.train_step(lambda m, b: "oops", af.optim.sgd(0.1))
    state = step.init(MLP())
    with pytest.raises(TypeError, match="loss_fn returned a str"):
        step(state, torch.randn(4, 8))


def test_batch_that_is_not_a_tensor_pytree_names_the_key():
    step = af.train_step(lambda m, b: m(b["x"]).sum(), af.optim.sgd(0.1))
    state = step.init(MLP())
    with pytest.raises(TypeError, match=r"batch\['text'\]\[1\] is a str") as e:
        step(state, {"x": torch.randn(4, 8), "text": [torch.zeros(1), "hello"]})
    fix = "drop the non-tensor fields before the step (e.g. {k: v for k, v in batch.items() if isinstance(v, torch"
    assert fix + ".Tensor)})" in str(e.value), e.value
    with pytest.raises(
        TypeError, match=r"batch\[1\] is a str: .*torch.Tensor; drop the non-tensor fields before the step$"
    ):
        step(state, [torch.randn(4, 8), "hello"])  # not a Mapping: no dict comprehension to suggest
    import numpy as np

    with pytest.raises(TypeError, match=r"batch\['x'\] is a ndarray.*torch.as_tensor"):
        step(state, {"x": np.zeros((4, 8))})


def _collated_batches():
    """Batches from Hugging Face's DataCollatorWithPadding through af.data.DataLoader: `BatchEncoding`s."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import DataCollatorWithPadding, PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", unk_token="[UNK]")
    texts = ["abc", "hello", "xyzzy", "a", "zz", "qq", "abz", "foo"]
    samples = [{**tok(t), "labels": int("z" in t)} for t in texts]
    return list(af.data.DataLoader(samples, batch_size=4, collate_fn=DataCollatorWithPadding(tok)))


def _tiny_classifier():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(cfg)


@pytest.mark.parametrize("micro", [1, 2], ids=["step", "accumulate2"])
def test_a_data_collator_batch_encoding_trains_and_evaluates_like_a_dict(micro):
    from transformers import BatchEncoding

    batches = _collated_batches()
    assert all(type(b) is BatchEncoding for b in batches)  # a UserDict, not a dict
    seen = []

    def loss_fn(m, b):
        seen.append(type(b))
        return m(**b).loss

    def make():
        step = af.train_step(loss_fn, af.optim.adamw(1e-2))
        return (af.accumulate(step, micro) if micro > 1 else step), af.eval_step(loss_fn)

    model = _tiny_classifier()
    (step, ev), (ref, ref_ev) = make(), make()
    state, ref_state = step.init(copy.deepcopy(model)), ref.init(copy.deepcopy(model))
    ev.init(step.model)
    ref_ev.init(ref.model)
    for b in batches:
        state, metrics = step(state, b)
        ref_state, ref_metrics = ref(ref_state, dict(b))  # what users had to write before
        assert torch.equal(metrics["loss"], ref_metrics["loss"])
        assert torch.equal(ev(state, b), ref_ev(ref_state, dict(b)))
    assert set(seen) == {dict}  # the loss function gets a plain dict of tensors
    for name, p in ref_state.params.items():
        assert torch.equal(state.params[name], p), name


def test_mappings_in_a_batch_become_dicts_and_other_containers_keep_their_type():
    from collections import OrderedDict, UserDict, namedtuple

    from accelfn.engine import plain_batch

    x = torch.zeros(2)
    plain = {"a": [x, (x,)], "b": OrderedDict(c=x)}
    assert plain_batch(plain) is plain  # nothing to convert: no copy
    Pair = namedtuple("Pair", "left right")
    out = plain_batch([Pair(UserDict(x=x), x), OrderedDict(u=UserDict(y=x)), (UserDict(z=x),)])
    assert type(out) is list and type(out[0]) is Pair and type(out[0].left) is dict and out[0].right is x
    assert type(out[1]) is OrderedDict and type(out[1]["u"]) is dict and type(out[2]) is tuple
    assert out[2][0] == {"z": x}
    step = af.train_step(lambda m, b: m(b["x"]).sum(), af.optim.sgd(0.1))
    state = step.init(MLP())
    with pytest.raises(TypeError, match=r"batch\['text'\] is a str"):  # errors name the key inside a Mapping
        step(state, UserDict(x=torch.randn(4, 8), text="hello"))


def test_the_loader_moves_the_tensors_of_a_batch_encoding_to_the_device(monkeypatch):
    from transformers import BatchEncoding

    meta = af.data.DataLayout(1, 0, torch.device("meta"), (0,))  # a non-CPU device: the loader moves batches
    monkeypatch.setattr(af.data.DataLayout, "resolve", staticmethod(lambda mesh: meta))

    def collate(rows):
        return BatchEncoding({"input_ids": torch.stack(rows), "extra": {"mask": torch.ones(len(rows))}})

    batches = list(
        af.data.DataLoader(list(torch.arange(8.0).reshape(4, 2)), batch_size=2, collate_fn=collate)
    )
    assert len(batches) == 2 and all(type(b) is BatchEncoding for b in batches)
    assert all(b["input_ids"].is_meta and b["extra"]["mask"].is_meta for b in batches)


def test_params_that_do_not_match_the_model_name_the_key():
    model = MLP()
    step = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1))
    state = step.init(model)
    bad_shape = state.replace(params={**state.params, "fc1.weight": torch.zeros(3, 3)})
    with pytest.raises(
        ValueError, match=r"params\['fc1.weight'\] has shape \(3, 3\) but the model expects \(16, 8\)"
    ):
        step(bad_shape, torch.randn(4, 8))
    missing = state.replace(params={k: v for k, v in state.params.items() if k != "fc2.bias"})
    with pytest.raises(KeyError, match=r"missing \['fc2.bias'\]"):
        step(missing, torch.randn(4, 8))
    extra = state.replace(params={**state.params, "fc3.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match=r"unexpected \['fc3.weight'\]"):
        step(extra, torch.randn(4, 8))


def test_public_constructors_check_argument_types():
    with pytest.raises(TypeError, match="'optimizer'"):
        af.train_step(lambda m, b: 0, "adamw")
    with pytest.raises(TypeError, match="'clip_grad_norm'"):
        af.train_step(lambda m, b: 0, af.optim.sgd(0.1), clip_grad_norm="1.0")
    with pytest.raises(TypeError, match="'loss_fn'"):
        af.train_step(3, af.optim.sgd(0.1))


def test_calling_before_init_is_a_clear_error():
    step = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1))
    other = af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1))
    state = other.init(MLP())
    with pytest.raises(RuntimeError, match=r"step.init\(model\)"):
        step(state, torch.randn(2, 8))


def test_loss_that_ignores_the_model_is_a_clear_error():
    detached = MLP()
    step = af.train_step(lambda m, b: detached(b).sum().detach(), af.optim.sgd(0.1))
    state = step.init(MLP())
    with pytest.raises(ValueError, match="does not depend on any trainable parameter"):
        step(state, torch.randn(2, 8))


def test_stale_gradients_left_by_another_backward_do_not_leak_into_the_update():
    """E.g. a GAN: the generator's backward writes .grad into the discriminator's params."""
    model = MLP()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    step = af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1))
    state = step.init(model)
    model(x).sum().backward()  # someone else's backward leaves gradients behind
    state, _ = step(state, x)
    ref(x).pow(2).mean().backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert max_param_diff(state.params, ref) <= 1e-7


# ---- optim.identity ---------------------------------------------------------------------------------------------
def _grads(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}


def test_optim_identity_passes_updates_through_unchanged():
    tx = af.optim.identity()
    params = {"w": torch.zeros(3, 4), "b": torch.zeros(4)}
    state = tx.init(params)
    assert state == af.optim.EmptyState()
    updates = _grads(0)
    expected = {k: v.clone() for k, v in updates.items()}
    out, new_state = tx.update(updates, state, params)
    assert new_state == af.optim.EmptyState()
    assert out.keys() == expected.keys()
    for k in expected:
        assert torch.equal(out[k], expected[k]) and out[k].dtype == expected[k].dtype
    out2, _ = tx.update(updates, state)  # params are optional
    assert all(torch.equal(out2[k], expected[k]) for k in expected)
    assert all(torch.equal(updates[k], expected[k]) for k in expected)  # the input is not modified


@pytest.mark.parametrize("where", ["first", "last", "both"])
@pytest.mark.parametrize(
    "make_tx", [lambda: af.optim.sgd(0.1, momentum=0.9), lambda: af.optim.adamw(1e-2)], ids=["sgd", "adamw"]
)
def test_optim_identity_in_a_chain_equals_the_other_transform_alone(where, make_tx):
    parts = {
        "first": lambda t: (af.optim.identity(), t),
        "last": lambda t: (t, af.optim.identity()),
        "both": lambda t: (af.optim.identity(), t, af.optim.identity()),
    }[where]
    alone, chained = make_tx(), af.optim.chain(*parts(make_tx()))
    inner = {"first": 1, "last": 0, "both": 1}[where]
    p_alone = {"w": torch.ones(3, 4), "b": torch.zeros(4)}
    p_chain = {k: v.clone() for k, v in p_alone.items()}
    s_alone, s_chain = alone.init(p_alone), chained.init(p_chain)
    p_pure_alone, p_pure_chain = dict(p_alone), dict(p_chain)
    s_pure_alone, s_pure_chain = s_alone, s_chain
    for i in range(3):
        # the pure path: update + apply_updates
        u_alone, s_pure_alone = alone.update(_grads(i), s_pure_alone, p_pure_alone)
        u_chain, s_pure_chain = chained.update(_grads(i), s_pure_chain, p_pure_chain)
        for k in u_alone:
            assert torch.equal(u_chain[k], u_alone[k]), (i, k)
        p_pure_alone = af.optim.apply_updates(p_pure_alone, u_alone)
        p_pure_chain = af.optim.apply_updates(p_pure_chain, u_chain)
        # the in-place path (fused `apply` when the chain's last part has one)
        s_alone = af.optim.apply_gradients(alone, _grads(i), s_alone, p_alone)
        s_chain = af.optim.apply_gradients(chained, _grads(i), s_chain, p_chain)
        for k in p_alone:  # a chain ending in identity has no fused `apply`: the same update, other rounding
            torch.testing.assert_close(p_chain[k], p_alone[k], rtol=0, atol=1e-6)
    assert af.tree.structure(s_pure_chain[inner]) == af.tree.structure(s_pure_alone)
    assert all(s == af.optim.EmptyState() for j, s in enumerate(s_chain) if j != inner)
    assert not torch.equal(p_alone["w"], torch.ones(3, 4))  # it did train


def test_optim_identity_in_a_chain_trains_like_the_optimizer_alone():
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    batches = [(torch.randn(8, 8), torch.randn(8, 4)) for _ in range(3)]

    def loss(m, b):
        return af.losses.mse(m(b[0]), b[1])

    chained = af.train_step(loss, af.optim.chain(af.optim.identity(), af.optim.adamw(1e-2)))
    alone = af.train_step(loss, af.optim.adamw(1e-2))
    s1, s2 = chained.init(model), alone.init(ref)
    for b in batches:
        s1, _ = chained(s1, b)
        s2, _ = alone(s2, b)
    for k in s2.params:
        torch.testing.assert_close(s1.params[k], s2.params[k], rtol=0, atol=1e-7)


# ---- the trainable set, metrics, empty batches -------------------------------------------------------------
def test_changing_requires_grad_after_init_is_a_clear_error():
    step = af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.adamw(0.1))
    state = step.init(MLP())
    step.model.fc1.weight.requires_grad_(False)  # frozen mid-training: Adam would move it by momentum
    with pytest.raises(ValueError, match=r"frozen after step.init\(\): \['fc1.weight'\]"):
        step(state, torch.randn(4, 8))
    step.model.fc1.weight.requires_grad_(True)
    frozen = MLP()
    frozen.fc2.bias.requires_grad_(False)
    step2 = af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.adamw(0.1))
    state2 = step2.init(frozen)
    step2.model.fc2.bias.requires_grad_(True)  # unfrozen: it would get gradients but never an update
    with pytest.raises(ValueError, match=r"unfrozen after step.init\(\): \['fc2.bias'\]"):
        step2(state2, torch.randn(4, 8))


def test_a_loss_whose_total_or_count_is_not_a_scalar_is_named_and_counts_stay_exact_in_bf16():
    step = af.train_step(
        lambda m, b: af.Loss(m(b).sum(), (b != 0).sum(-1)), af.optim.sgd(0.1)
    )  # .sum() forgotten
    state = step.init(torch.nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"Loss.count must be a scalar .* got a tensor of shape \(3,\)"):
        step(state, torch.ones(3, 4))
    step = af.train_step(lambda m, b: af.Loss(m(b), 3), af.optim.sgd(0.1))
    state = step.init(torch.nn.Linear(4, 2))
    with pytest.raises(
        ValueError, match=r"Loss.total must be a scalar tensor, got a tensor of shape \(3, 2\)"
    ):
        step(state, torch.ones(3, 4))
    # a bf16 total (no .float()): the count of 301 must not round to 300 (it did: the count took total's dtype)
    model = torch.nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        model.weight.fill_(1.0)
    step = af.train_step(lambda m, b: af.Loss(m(b).sum(), torch.tensor(301)), af.optim.sgd(0.0))
    state = step.init(model)
    _, metrics = step(state, torch.ones(128, 4, dtype=torch.bfloat16))  # a total of 512, exact in bf16
    torch.testing.assert_close(
        metrics["loss"].float(), torch.tensor(512 / 301), rtol=1e-3, atol=0
    )  # not 512 / 300


def test_a_state_of_another_live_training_step_is_refused_naming_it():
    # e.g. a re-run notebook cell: the old step still trains the state's params (it blamed "frozen params")
    loss = lambda m, b: m(b).pow(2).mean()  # noqa: E731
    old_step = af.train_step(loss, af.optim.adamw(1e-3))
    old_state = old_step.init(torch.nn.Linear(4, 2))
    new_step = af.train_step(loss, af.optim.adamw(1e-3))
    new_step.init(torch.nn.Linear(4, 2))
    with pytest.raises(
        ValueError, match=r"this state belongs to another training step: its params \['weight', 'bias'\]"
    ):
        new_step(old_state, torch.randn(2, 4))
    copy = af.tree.map(torch.clone, old_state)  # the advised way to start from its values
    state, _ = new_step(copy, torch.randn(2, 4))
    assert int(state.step) == 1
    old_state, _ = old_step(old_state, torch.randn(2, 4))  # and the other step still trains its own
    assert int(old_state.step) == 1


def test_freezing_as_the_error_advises_leaves_the_params_unchanged_and_trains_the_rest_as_torch():
    # the advice of the error above: keep them trainable and zero their updates with af.optim.freeze (masked
    # alone passes their gradient through as the update: a step *up* the loss with lr 1)
    torch.manual_seed(0)
    model, ref = MLP(), MLP()
    ref.load_state_dict(model.state_dict())
    frozen = {n: n.startswith("fc1.") for n, _ in model.named_parameters()}
    step = af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.chain(af.optim.adamw(0.1, weight_decay=0.1),
                                                                         af.optim.freeze(frozen)))  # fmt: skip
    with pytest.raises(ValueError, match=r"af.optim.chain\(optimizer, af.optim.freeze\(mask\)\)"):
        s = af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.adamw(0.1))
        st = s.init(MLP())
        s.model.fc1.weight.requires_grad_(False)
        s(st, torch.randn(4, 8))
    state = step.init(model)
    before = {n: p.clone() for n, p in state.params.items()}
    opt = torch.optim.AdamW([p for n, p in ref.named_parameters() if not frozen[n]], lr=0.1, weight_decay=0.1)
    for i in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        state, _ = step(state, x)
        opt.zero_grad()
        ref(x).pow(2).mean().backward()
        opt.step()
    for n, p in ref.named_parameters():
        if frozen[n]:
            assert torch.equal(state.params[n], before[n]), n
        else:
            assert not torch.equal(state.params[n], before[n]), n
            torch.testing.assert_close(state.params[n], p.detach(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("micro", [1, 2])
def test_aux_metrics_are_scalars_and_numbers_are_accepted(micro):
    def loss_fn(m, b):
        out = m(b)
        return out.pow(2).mean(), {"pred": out.detach(), "acc": 0.5}

    step = af.train_step(loss_fn, af.optim.sgd(0.1))
    step = af.accumulate(step, micro) if micro > 1 else step
    state = step.init(MLP())
    with pytest.raises(ValueError, match=r"aux\['pred'\] has shape \(\d+, 4\); aux values are metrics"):
        step(state, torch.randn(4, 8))
    scalar = af.train_step(lambda m, b: (m(b).pow(2).mean(), {"acc": 0.5, "n": torch.tensor([3.0])}),
                           af.optim.sgd(0.1))  # fmt: skip
    scalar = af.accumulate(scalar, micro) if micro > 1 else scalar
    _, metrics = scalar(scalar.init(MLP()), torch.randn(4, 8))
    assert metrics["acc"].item() == 0.5 and metrics["n"].item() == 3.0 and metrics["n"].dim() == 0
    with pytest.raises(TypeError, match=r"aux\['name'\] is a str"):
        bad = af.train_step(lambda m, b: (m(b).pow(2).mean(), {"name": "x"}), af.optim.sgd(0.1))
        bad(bad.init(MLP()), torch.randn(4, 8))


@pytest.mark.parametrize("micro", [1, 2])
def test_a_batch_with_no_valid_label_gives_zero_loss_and_no_update(micro):
    # all labels ignored: count 0. Was NaN (0/0) in the one-micro-batch path, poisoning the params.
    step = af.train_step(lambda m, b: af.losses.cross_entropy(m(b["x"]), b["y"]), af.optim.sgd(0.1))
    step = af.accumulate(step, micro) if micro > 1 else step
    state = step.init(MLP())
    before = {k: v.detach().clone() for k, v in state.params.items()}
    state, metrics = step(state, {"x": torch.randn(4, 8), "y": torch.full((4,), -100)})
    assert metrics["loss"].item() == 0.0
    assert all(torch.equal(state.params[k], before[k]) for k in before)


def test_a_state_from_another_step_and_a_misfit_mask_fail_early_and_clearly():
    net = MLP()
    evaluate = af.eval_step(lambda m, b: m(b))
    eval_state = evaluate.init(net)
    train = af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.sgd(0.1))
    train.init(net)
    with pytest.raises(
        ValueError, match="state.opt_state is a tuple, but this step's optimizer keeps a SgdState"
    ):
        train(eval_state, torch.randn(4, 8))
    frozen = MLP()
    frozen.fc1.bias.requires_grad_(False)
    mask = {n: n.endswith("weight") for n, _ in frozen.named_parameters()}  # built from all params
    step = af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.adamw(1e-3, weight_decay=0.1, mask=mask))
    with pytest.raises(ValueError, match="mask structure does not match params.*trainable params only"):
        step.init(frozen)


def test_a_dict_of_lists_is_a_clear_data_loader_error():
    with pytest.raises(TypeError, match=r"only when every value is a tensor.*'x': 'list'"):
        af.data.DataLoader({"x": [1, 2, 3], "y": torch.arange(3)}, batch_size=2)


def test_a_donated_state_passed_again_is_an_error_naming_the_fix(tmp_path):
    # The step updates the state it is given in place (donation, as jax.jit's donate_argnums): a second call with
    # that state would apply a second update on top of the first and report a wrong step count (JAX raises too).
    step = af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.adamw(1e-2))
    old = step.init(torch.nn.Linear(4, 2))
    new, _ = step(old, torch.randn(8, 4))
    with pytest.raises(ValueError, match="was already passed to a training step, which donated it"):
        step(old, torch.randn(8, 4))
    snapshot = af.tree.map(torch.clone, new)  # the documented way to keep a state
    newer, _ = step(new, torch.randn(8, 4))
    step(snapshot, torch.randn(8, 4))  # a clone is a state of its own
    # saving or evaluating the donated state would mix the new params with the old step count: refused too
    with pytest.raises(
        ValueError, match=r"af.checkpoint.save: this state .* was already passed to a training step"
    ):
        af.checkpoint.save(tmp_path / "old", old)
    assert not (tmp_path / "old").exists()
    with pytest.raises(ValueError, match="af.checkpoint.save_pretrained: this state"):
        af.checkpoint.save_pretrained(tmp_path / "hf", old, config={"model_type": "x"})
    evaluate = af.eval_step(lambda m, b: m(b))
    evaluate.init(step.model)
    with pytest.raises(ValueError, match="an eval step: this state"):
        evaluate(old, torch.randn(8, 4))
    evaluate(newer, torch.randn(8, 4))
    af.checkpoint.save(tmp_path / "new", newer)
    loaded = af.checkpoint.load(
        tmp_path / "new", like=newer
    )  # `like` is donated too: its tensors were filled
    with pytest.raises(
        ValueError, match=r"was already passed to af.checkpoint.load \(as `like`\), which donated it"
    ):
        step(newer, torch.randn(8, 4))
    step(loaded, torch.randn(8, 4))
    keep = af.train_step(lambda m, b: m(b).pow(2).mean(), af.optim.adamw(1e-2), donate=False)
    first = keep.init(torch.nn.Linear(4, 2))
    a, _ = keep(first, torch.ones(8, 4))
    b, _ = keep(first, torch.ones(8, 4))  # without donation the input stays valid
    assert torch.equal(a.params["weight"], b.params["weight"])


def test_a_launcher_precision_flag_without_autocast_warns(monkeypatch):
    # `accelfn launch --mixed-precision bf16` sets ACCELFN_MIXED_PRECISION; a step without af.autocast would
    # silently compute in fp32 (Accelerate applies its flag to every forward): say how to use it
    monkeypatch.setenv("ACCELFN_MIXED_PRECISION", "bf16")
    base = af.train_step(lambda m, b: m(b).float().pow(2).mean(), af.optim.sgd(0.1))
    with pytest.warns(
        UserWarning, match=r"ACCELFN_MIXED_PRECISION=bf16 .* has no effect on this step.*af.autocast\(step\)"
    ):
        base.init(torch.nn.Linear(2, 2))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        af.autocast(base).init(torch.nn.Linear(2, 2))  # picks the flag up: no warning
