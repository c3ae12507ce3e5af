"""benchmarks/sdpa_calls.py on a tiny Llama: each mode passes SDPA what it claims (docs/dry_run.md item 9)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def sdpa_calls():
    spec = importlib.util.spec_from_file_location("sdpa_calls", BENCHMARKS / "sdpa_calls.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["sdpa_calls"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["sdpa_calls"]


def calls(sdpa_calls, mode):
    # dynamo's graphs without inductor, the forward only: what transformers passes is decided while tracing
    return sdpa_calls.run(mode, "cpu", "wrapper", layers=1, batch=2, seq=8, backend="eager", backward=False)


def test_mask_facts_tells_a_causal_mask_from_a_padding_mask(sdpa_calls):
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    padded = causal.clone()
    padded[:, 0] = False  # the first key is padding
    assert sdpa_calls.mask_facts(causal[None, None], 8, 8)["causal"]
    assert not sdpa_calls.mask_facts(padded[None, None], 8, 8)["causal"]
    additive = torch.zeros(8, 8).masked_fill(~causal, float("-inf"))
    assert sdpa_calls.mask_facts(additive[None, None], 8, 8)["causal"]


@pytest.mark.parametrize("mode", ["eager", "compile-skipmask"])
def test_modes_without_a_mask_pass_is_causal_and_gqa(sdpa_calls, mode):
    (call,) = calls(sdpa_calls, mode)
    assert call["mask"] is None and call["is_causal"] and call["enable_gqa"]
    assert call["k_shape"][1] == 2  # the key/value heads, not repeated


@pytest.mark.parametrize("mode", ["compile", "eager-mask"])
def test_compile_passes_transformers_causal_mask_and_eager_mask_does_the_same(sdpa_calls, mode):
    # under torch.compile transformers builds its causal mask (its packed-sequence check answers "packed" when
    # traced): what the dry run's traced_mask charges as a full attention; eager-mask runs that call eagerly
    (call,) = calls(sdpa_calls, mode)
    assert call["mask"] == [2, 1, 8, 8] and call["causal"] and not call["is_causal"]
    assert call["k_shape"][1] == 4  # repeated to the query heads


def test_eager_mask_computes_what_eager_does(sdpa_calls):
    from transformers import LlamaForCausalLM

    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    logits = {}
    for mode in ("eager", "eager-mask"):
        with sdpa_calls.transformers_mode(mode):
            torch.manual_seed(0)
            logits[mode] = LlamaForCausalLM(sdpa_calls.llama_config("cpu", layers=1))(input_ids=ids).logits
    torch.testing.assert_close(logits["eager-mask"], logits["eager"], rtol=1e-5, atol=1e-5)
