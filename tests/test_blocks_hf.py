"""A Hugging Face model's blocks (`accelfn/blocks.py`): its `_no_split_modules` that are items of a layer stack,
the same for af.pipeline's split, af.remat and af.compile / FSDP's per-block units. BERT lists `BertEmbeddings`
in `_no_split_modules` beside `BertLayer`: its embeddings are not a block."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import accelfn as af
from accelfn.blocks import no_split_blocks, outermost
from accelfn.stages import balanced_split, decoder_layers
from accelfn.transforms.compile import find_blocks, model_blocks
from accelfn.transforms.remat import find_remat_blocks
from tests._launch import output_of, run_workers


def bert(layers: int = 4) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                     num_attention_heads=2, max_position_embeddings=32)  # fmt: skip
    return BertForMaskedLM(cfg)


def t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                   decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    return T5ForConditionalGeneration(cfg)


ENCODER = [f"bert.encoder.layer.{i}" for i in range(4)]


def test_bert_blocks_are_its_encoder_layers_for_the_pipeline_remat_and_compile():
    model = bert()
    assert "BertEmbeddings" in model._no_split_modules  # what made the embeddings a block
    names = {id(m): n for n, m in model.named_modules()}
    assert decoder_layers(model) == ENCODER
    what, blocks = find_remat_blocks(model)
    assert what == "BertLayer" and [names[id(b)] for b in blocks] == ENCODER
    name, stack = find_blocks(model)  # af.compile(regions='blocks') and FSDP's per-block units
    assert name == "bert.encoder.layer" and [names[id(b)] for b in stack] == ENCODER


def test_a_bert_pipeline_is_no_deeper_than_its_encoder_layers():
    model = bert()
    assert balanced_split(model, 4).points == tuple(ENCODER[1:])  # the embeddings go with layer 0
    with pytest.raises(ValueError, match="only 4 decoder layers"):
        balanced_split(model, 5)  # the embeddings alone are no stage


def test_remat_every_second_block_of_bert_checkpoints_encoder_layers_1_and_3():
    step = af.remat(
        af.train_step(lambda m, b: m(input_ids=b).logits.sum(), af.optim.sgd(0.1)), "full", every=2
    )
    step.init(bert(), seed=0)
    model = step.model
    done = [n for n, m in model.named_modules() if getattr(m, "_accelfn_remat", None) is not None]
    assert done == ["bert.encoder.layer.1", "bert.encoder.layer.3"]
    assert "on 2 of 4 blocks (BertLayer)" in str(step)


def test_blocks_of_both_t5_stacks_and_the_fallback_when_no_match_is_in_a_stack():
    model = t5()
    assert [n for n, _ in no_split_blocks(model)] == [
        "encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"
    ]  # fmt: skip

    class Layer(nn.Linear):
        pass

    class Net(nn.Module):  # blocks that are attributes, not items of a list: every match is kept
        _no_split_modules = ["Layer"]

        def __init__(self):
            super().__init__()
            self.a, self.b = Layer(2, 2), Layer(2, 2)

    assert [n for n, _ in no_split_blocks(Net())] == ["a", "b"]
    assert [n for n, _ in outermost(Net(), ["Layer"], repeated=True)] == []


def test_fsdp_and_compile_take_the_blocks_of_both_t5_stacks():
    # find_blocks alone gives the larger stack (the decoder's, with cross-attention): FSDP left the encoder's
    # blocks in its root unit and compile left them eager; a model without two stacks keeps its one list
    model = t5()
    assert find_blocks(model)[0] == "decoder.block"
    name, blocks = model_blocks(model)
    names = {id(m): n for n, m in model.named_modules()}
    assert name == "encoder.block, decoder.block"
    assert [names[id(b)] for b in blocks] == [
        f"{s}.block.{i}" for s in ("encoder", "decoder") for i in range(2)
    ]
    assert model_blocks(bert())[0] == find_blocks(bert())[0] == "bert.encoder.layer"

    def loss_fn(m, b):
        return af.losses.cross_entropy(m(input_ids=b, labels=b).logits, b)

    batch = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    eager = af.train_step(loss_fn, af.optim.sgd(0.1))
    compiled = af.compile(af.train_step(loss_fn, af.optim.sgd(0.1)), regions="blocks", backend="eager")
    torch.manual_seed(0)
    first = t5()
    a, b = eager.init(copy.deepcopy(first), seed=0), compiled.init(first, seed=0)
    assert "compiled 4/4 blocks of encoder.block, decoder.block" in repr(compiled), repr(compiled)
    (a, ma), (b, mb) = eager(a, batch), compiled(b, batch)
    assert torch.equal(ma["loss"], mb["loss"]) and all(
        torch.equal(a.params[k], b.params[k]) for k in a.params
    )


def test_bert_pp2_on_two_processes_equals_one_process():
    # stage 1 holds the tied word embeddings inside `bert.embeddings` (called with keywords) for the head
    proc = run_workers("pp_bert_worker.py", 2, timeout=120)
    assert proc.returncode == 0, output_of(proc)
    assert proc.stdout.count("BERT PP OK") == 2, output_of(proc)


# ---- stand-ins for other stages' modules, and blocks outside a layer list ---------------------------------------
def test_stand_ins_make_up_nan_outside_a_dry_run_and_zeros_inside() -> None:
    """A stage's stand-in output is replaced by the stage's received input; a model that reads it by another
    path must not train on made-up zeros (the review's Gemma3n / T5 case): NaN shows it. In a dry run, zeros."""
    from transformers import BertConfig, BertModel

    from accelfn import dry_mode
    from accelfn.stages import bypass_forward

    bert = BertModel(
        BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    )
    ids = torch.tensor([[1, 2, 3]])
    stand_ins = [
        (bypass_forward(nn.Embedding(10, 8)), (ids,), {}, (1, 3, 8)),
        (bypass_forward(nn.Linear(4, 6)), (torch.ones(2, 4),), {}, (2, 6)),
        (bypass_forward(bert.embeddings), (), {"input_ids": ids, "token_type_ids": None}, (1, 3, 32)),
    ]
    for forward, args, kwargs, shape in stand_ins:
        out = forward(*args, **kwargs)
        assert out.shape == shape and out.isnan().all(), out
        with dry_mode.watching(dry_mode.Watcher()):
            out = forward(*args, **kwargs)
        assert out.shape == shape and not out.any(), out
    # an integer table has no NaN: zeros
    table = nn.Embedding(10, 8)
    table.weight = nn.Parameter(torch.zeros(10, 8, dtype=torch.int64), requires_grad=False)
    out = bypass_forward(table)(ids)
    assert out.dtype == torch.int64 and not out.any()


def test_a_stand_in_for_a_module_holding_a_layer_stack_refuses_keywords_only() -> None:
    """T5's encoder stack called with `input_ids=` only: not a split point (the stack inside it is), so the
    stand-in raises rather than making up the stack's output."""
    from transformers import T5Config, T5ForConditionalGeneration

    from accelfn.stages import bypass_forward

    t5 = T5ForConditionalGeneration(
        T5Config(
            d_model=16, d_ff=32, num_layers=2, num_heads=2, d_kv=8, vocab_size=40, decoder_start_token_id=0
        )
    )
    with pytest.raises(
        TypeError, match="T5Stack of another stage was called with keywords only, and it holds"
    ):
        bypass_forward(t5.encoder)(input_ids=torch.tensor([[1, 2]]))
    hidden = torch.ones(1, 2, 16)
    assert bypass_forward(t5.encoder.block[0])(hidden) is hidden  # a block: the hidden state goes through


def test_blocks_in_a_module_dict_beside_a_layer_list_warn_and_the_larger_stack_is_taken() -> None:
    class Block(nn.Linear):
        pass

    class Net(nn.Module):
        _no_split_modules = ["Block"]

        def __init__(self, listed: int, keyed: int) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Block(2, 2) for _ in range(listed)])
            self.heads = nn.ModuleDict({str(i): Block(2, 2) for i in range(keyed)})

    with pytest.warns(UserWarning, match=r"Net: Block modules sit both .* the larger stack, layers\.0 \.\.\. \(3\); "
                      r"not taken, in a ModuleDict: heads\.0, heads\.1"):  # fmt: skip
        assert [n for n, _ in no_split_blocks(Net(3, 2))] == ["layers.0", "layers.1", "layers.2"]
    with pytest.warns(
        UserWarning, match=r"the larger stack, heads\.0 \.\.\. \(3\); not taken, in a layer list: layers\.0"
    ):
        assert [n for n, _ in no_split_blocks(Net(1, 3))] == ["heads.0", "heads.1", "heads.2"]
    # a ModuleDict holding a model whose layer list is found: no warning (the dict's match holds the blocks)
    outer = nn.Module()
    outer._no_split_modules = ["Block", "Net"]  # type: ignore[assignment]
    outer.towers = nn.ModuleDict({"text": Net(2, 0)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [n for n, _ in no_split_blocks(outer)] == ["towers.text.layers.0", "towers.text.layers.1"]


def test_a_stage_reading_a_stand_ins_output_by_another_path_is_named_in_a_warning() -> None:
    """Every block reads the embedding's output directly (as Gemma3n's per-layer inputs do): the second stage's
    stand-in for the embedding makes up NaN that its received input does not replace, and the loss is NaN. The
    first micro-batch's check names the stand-in (one process, two stages); a model reading only the hidden
    state trains and warns nothing."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, h: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
            return torch.tanh(self.lin(h)) + (0 if extra is None else extra)

    class Net(nn.Module):
        def __init__(self, side: bool) -> None:
            super().__init__()
            # registered in the order the forward runs them (the split's order)
            self.embed = nn.Embedding(16, 8)
            self.layers = nn.ModuleList([Block() for _ in range(4)])
            self.head, self.side = nn.Linear(8, 4), side

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = first = self.embed(ids)
            for layer in self.layers:
                h = layer(h, first if self.side else None)
            return self.head(h)

    def loss_fn(m: nn.Module, b: dict[str, torch.Tensor]) -> af.Loss:
        return af.losses.cross_entropy(m(b["ids"]), b["y"])

    from accelfn import mesh as _mesh

    g = torch.Generator().manual_seed(0)
    batch = {"ids": torch.randint(0, 16, (4, 5), generator=g), "y": torch.randint(0, 4, (4, 5), generator=g)}
    try:
        _check_stand_in_warning(loss_fn, Net, batch)
    finally:
        _mesh.destroy_process_group()  # the pp=1 mesh's (later tests dry-run, which starts its own)


def _check_stand_in_warning(loss_fn: Any, net: Any, batch: dict[str, torch.Tensor]) -> None:
    for side in (False, True):
        torch.manual_seed(0)
        step = af.pipeline(af.train_step(loss_fn, af.optim.sgd(0.1)), af.Mesh({"pp": 1}, device="cpu"),
                           microbatches=2, schedule="interleaved_1f1b", stages_per_rank=2)  # fmt: skip
        state = step.init(net(side))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            state, metrics = step(state, batch)
            state, metrics2 = step(state, batch)  # once per stage: the second step does not check again
        named = [str(w.message) for w in seen if "stand-ins" in str(w.message)]
        assert math.isnan(metrics["loss"].item()) == side
        if side:
            assert len(named) == 1 and "stage 1's output is NaN" in named[0] and "(Embedding)" in named[0], (
                named
            )
        else:
            assert named == [], named
