"""The modules torch ships, built on the meta device (`af.init_empty()`), materialise in `step.init` with torch's
own init rules: `reset_parameters()`, `nn.MultiheadAttention._reset_parameters()`, and `nn.Transformer`'s
xavier-uniform of every matrix; and a model of them trains as torch trains the same values.

The reference is torch's own rule run on a host-built module, seeded as the docs say `step.init` seeds each
module (its own generator from the step's seed and the module's name); where a rule spans modules
(`nn.Transformer`), the distribution of a host build.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import accelfn as af
from accelfn.materialize import has_meta

SEED = 5


def _module_seed(seed: int, name: str) -> int:
    """The seed the docs give module `name`: its own generator, from `step.init`'s seed and its name."""
    return af.random.seed_of(af.random.fold_in(af.random.key(seed), zlib.crc32(name.encode())))


def _torch_rule(m: nn.Module) -> Callable[[], None] | None:
    """torch's init rule of `m`'s own tensors: `reset_parameters()`, else its private `_reset_parameters()`."""
    return getattr(m, "reset_parameters", None) or getattr(m, "_reset_parameters", None)


def _host_reference(build: Callable[[], nn.Module], seed: int) -> nn.Module:
    """`build()` on the host, each module with tensors of its own re-initialised by torch's rule, children first,
    from the module's own seed."""
    model = build()
    for name, m in reversed(list(model.named_modules())):
        if any(p is not None for p in m._parameters.values()):
            rule = _torch_rule(m)
            assert rule is not None, name
            torch.manual_seed(_module_seed(seed, name))
            rule()
    return model


def _materialised(build: Callable[[], nn.Module], seed: int) -> af.TrainState:
    with af.init_empty():
        meta = build()
    assert has_meta(meta)
    return af.train_step(lambda m, b: m(b).sum(), af.optim.sgd(0.1)).init(meta, seed=seed)


STOCK: dict[str, Callable[[], nn.Module]] = {
    "multihead_attention": lambda: nn.MultiheadAttention(16, 4),
    "multihead_attention_kdim_vdim_bias_kv": lambda: nn.MultiheadAttention(
        16, 4, kdim=8, vdim=12, add_bias_kv=True, batch_first=True
    ),
    "transformer_encoder_layer": lambda: nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True),
    "transformer_decoder_layer": lambda: nn.TransformerDecoderLayer(16, 4, 32, norm_first=True),
    "layer_norm": lambda: nn.LayerNorm(8),
    "rms_norm": lambda: nn.RMSNorm(8),
    "group_norm": lambda: nn.GroupNorm(2, 8),
    "batch_norm": lambda: nn.BatchNorm2d(8),
    "instance_norm_affine": lambda: nn.InstanceNorm1d(8, affine=True),
    "embedding_padding_idx": lambda: nn.Embedding(12, 4, padding_idx=3),
    "embedding_bag": lambda: nn.EmbeddingBag(12, 4, mode="mean"),
    "conv1d": lambda: nn.Conv1d(3, 8, 5, groups=1),
    "conv2d_grouped": lambda: nn.Conv2d(4, 8, 3, groups=2),
    "conv3d": lambda: nn.Conv3d(2, 4, 3, bias=False),
    "conv_transpose2d": lambda: nn.ConvTranspose2d(3, 6, 3),
    "rnn": lambda: nn.RNN(8, 16, num_layers=2),
    "lstm_bidirectional_proj": lambda: nn.LSTM(8, 16, num_layers=2, proj_size=4, bidirectional=True),
    "gru": lambda: nn.GRU(8, 16, batch_first=True),
    "lstm_cell": lambda: nn.LSTMCell(4, 8),
    "bilinear": lambda: nn.Bilinear(3, 4, 5),
    "prelu": lambda: nn.PReLU(8),
}


@pytest.mark.parametrize("name", list(STOCK))
def test_stock_module_built_on_meta_equals_torchs_own_init_under_the_documented_seeds(name: str) -> None:
    state = _materialised(STOCK[name], SEED)
    expected = _host_reference(STOCK[name], SEED).state_dict()
    got = {**state.params, **state.buffers}
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key].device == value.device and torch.equal(got[key], value), f"{name}: {key}"


def test_multihead_attention_gets_its_own_rule_not_linears() -> None:
    """`_reset_parameters`: xavier-uniform in_proj, zero in_proj and out_proj biases (over out_proj's own rule)."""
    state = _materialised(lambda: nn.MultiheadAttention(64, 4), SEED)
    in_proj, params = state.params["in_proj_weight"], state.params
    bound = math.sqrt(6 / (64 + 3 * 64))  # xavier over the (192, 64) matrix
    assert in_proj.abs().max() <= bound and in_proj.abs().max() > 0.95 * bound
    assert params["in_proj_bias"].eq(0).all() and params["out_proj.bias"].eq(0).all()
    assert params["out_proj.weight"].abs().max() <= 1 / math.sqrt(64)  # out_proj keeps Linear's rule


def _ks(a: torch.Tensor, b: torch.Tensor) -> float:
    """sqrt(n) x the two-sample Kolmogorov-Smirnov statistic of the values of `a` and `b` (each n values)."""
    a, b = a.detach().flatten().double().sort().values, b.detach().flatten().double().sort().values
    grid = torch.cat([a, b])
    cdf_a = torch.searchsorted(a, grid, right=True) / a.numel()
    cdf_b = torch.searchsorted(b, grid, right=True) / b.numel()
    return float((cdf_a - cdf_b).abs().max()) * math.sqrt(a.numel() / 2)


def _ks_uniform(x: torch.Tensor, bound: float) -> float:
    """sqrt(n) x the one-sample Kolmogorov-Smirnov statistic of the values of `x` against U(-bound, bound)."""
    x = x.detach().flatten().double().sort().values
    n = x.numel()
    cdf = (x + bound) / (2 * bound)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(i / n - cdf, cdf - (i - 1) / n).max()) * math.sqrt(n)


KS_0_1_PERCENT = 1.95  # the Kolmogorov distribution's 99.9% quantile


def _transformer() -> nn.Transformer:
    return nn.Transformer(32, 4, 2, 2, 64, dropout=0.0, batch_first=True)


@pytest.mark.filterwarnings("error")  # nn.Transformer's rule is run: no "reset_parameters() not run" warning
def test_torch_transformer_matrices_are_xavier_as_a_host_build_gives_them() -> None:
    """`nn.Transformer._reset_parameters` re-initialises every matrix of its subtree after the children's rules:
    on the meta device each module draws its own, so the values follow torch's distribution, not its draws."""
    state = _materialised(_transformer, SEED)
    torch.manual_seed(0)
    host = _transformer().state_dict()
    assert set(state.params) <= set(host)
    matrices = 0
    for key, value in state.params.items():
        ref = host[key]
        if value.dim() > 1:  # xavier-uniform of this matrix's shape, as in the host build
            bound = math.sqrt(6 / sum(value.shape[:2]))
            assert _ks_uniform(value, bound) < KS_0_1_PERCENT and _ks_uniform(ref, bound) < KS_0_1_PERCENT, (
                key
            )
            assert _ks(value, ref) < KS_0_1_PERCENT, key
            matrices += 1
        elif ref.unique().numel() == 1:  # constants: norms' ones and zeros, attention biases' zeros
            assert torch.equal(value, ref), key
        else:  # Linear biases: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), drawn by each Linear's own rule
            assert value.abs().max() <= ref.abs().max() * 1.5 and not torch.equal(value, ref), key
    assert matrices == 20
    # the test tells the rules apart: a Linear's own (kaiming) rule is not xavier
    linear1 = state.params["encoder.layers.0.linear1.weight"]
    assert _ks_uniform(nn.Linear(32, 64).weight, math.sqrt(6 / sum(linear1.shape))) > 3 * KS_0_1_PERCENT


class _Tagger(nn.Module):
    """Embedding -> torch transformer encoder -> LSTM -> Linear: stock modules only."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16, padding_idx=0)
        layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.rnn = nn.LSTM(16, 8, batch_first=True)
        self.head = nn.Linear(8, 20)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.encoder(self.emb(tokens)))[0])


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def test_a_meta_built_model_of_stock_modules_trains_as_torch_trains_its_values() -> None:
    with af.init_empty():
        meta = _Tagger()
    step = af.train_step(_loss, af.optim.sgd(0.1, momentum=0.9))
    state = step.init(meta, seed=SEED)
    host = _Tagger()
    host.load_state_dict({**state.params, **state.buffers})
    # a host build's encoder layers are deep copies of one layer: equal biases; built on meta each layer draws
    assert not torch.equal(
        state.params["encoder.layers.0.linear1.bias"], state.params["encoder.layers.1.linear1.bias"]
    )
    opt = torch.optim.SGD(host.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        tokens = torch.randint(1, 20, (4, 9), generator=gen)
        state, metrics = step(state, tokens)
        loss = _loss(host, tokens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch.testing.assert_close(metrics["loss"], loss.detach(), rtol=1e-5, atol=1e-6)
    for key, value in host.state_dict().items():
        torch.testing.assert_close(state.params.get(key, state.buffers.get(key)), value, rtol=1e-4, atol=1e-6)
