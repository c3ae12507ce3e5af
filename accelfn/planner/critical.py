"""The planner's estimate, before a candidate runs, of the collectives on its step's critical path that move
activations: tensor parallel's sequence gathers and scatters and context parallel's key/value gathers.

The dry run puts them on the critical path (`step_time.predict_step`: nothing overlaps them), so a mesh with tp
or cp pays their time on top of its compute. The probe (one process, no tp or cp) records the decoder's shape
(`decoder_shape`: its blocks, hidden width, key/value width and activation bytes); the lowering moves, per
micro-batch on each rank (`T` the micro-batch's tokens on the rank's cp part, `H` the hidden width):

- tensor parallel (sequence parallel, the lowering's default for a Hugging Face decoder,
  `tensor_parallel.sequence_parallel_styles`): the attention's and the MLP's inputs all-gathered over tp and
  their row-wise outputs reduce-scattered, 2 of each per block, and the head's input gathered and the
  embedding's output scattered, each `T x H` activations; the backward reverses each (a gather's gradient is
  scattered, a scatter's gathered). Recomputed blocks gather again (full and selective remat: the
  collectives are not saved) and full remat scatters the attention's output again (torch's checkpoint stops
  recomputing once the saved tensors it needs are back, before the MLP's output). torchao's float8 styles
  (`af.autocast_fp8`'s tensorwise recipe) gather the blocks' inputs and the row-wise outputs' gradients in
  fp8 (1 byte); the rowwise recipe uses torch's styles (as held);
- context parallel (`context_parallel`): each attention all-gathers its keys and values over cp (this tp
  rank's key/value heads), `T x cp` rows of the key/value width each, and the backward reduce-scatters their
  gradients; recomputed blocks gather again.

Activations are counted at 2 bytes under af.autocast (the matmuls' bf16 inputs, where the dry run sees the
gathers) and as the params are held otherwise. A pipeline stage holds `blocks / pp` of them (and, counted on
every stage, the head's gather and the embedding's scatter). Not counted: the small all-reduces (norm weights'
gradients, fp8 scales), padding of a sequence tp does not divide, a script's own `tp_plan` (counted as the
model's) or `sequence_parallel=False` (all-reduces instead). Checked against dry runs of a tiny Llama
(tests/test_plan_critical.py: bf16 and fp32, full and selective remat, fp8, cp with tp, within 3%).

Example:
    >>> from accelfn.planner.candidates import Candidate
    >>> from accelfn.platforms.specs import spec
    >>> decoder = {"blocks": 32, "hidden": 4096, "kv_width": 1024, "bytes": 4}  # Llama 3 8B
    >>> c = Candidate({"dp": 8, "tp": 8}, "fsdp", "full", accumulate=1)
    >>> t = critical_traffic(c, decoder, 64 * 8192, spec("h100-sxm"), 8, autocast=True)
    >>> t.moved["all_gather", ("tp",)] / 2**30  # GiB a rank gathers a step: 194 gathers of 8 x 8192 x 4096 bf16
    97.0
"""

from __future__ import annotations

import math
import re
from typing import Any

from torch import nn

from ..platforms.specs import DeviceSpec
from .candidates import Candidate, data_size
from .traffic import Traffic

__all__ = ["decoder_shape", "critical_traffic", "gathers_in_fp8"]


def decoder_shape(model: nn.Module) -> dict[str, int]:
    """What tp's and cp's collectives move, as far as the model says: its repeated `blocks` (as remat and the
    pipeline find them), the `hidden` width (`config.hidden_size`), the keys' and values' width (`kv_width`:
    `num_key_value_heads x head_dim`) and the `bytes` of a param as held; an empty dict for a model whose
    config gives neither width, or without blocks.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
        ...                   num_attention_heads=4, num_key_value_heads=2)
        >>> decoder_shape(LlamaForCausalLM(cfg)), decoder_shape(nn.Linear(2, 2))
        ({'blocks': 3, 'hidden': 16, 'kv_width': 8, 'bytes': 4}, {})
    """
    from ..transforms.remat import find_remat_blocks

    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not isinstance(hidden, int) or not isinstance(heads, int) or not isinstance(kv_heads, int):
        return {}
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    try:
        _, blocks = find_remat_blocks(model)
    except ValueError:
        return {}
    first = next((p for p in model.parameters() if p.is_floating_point()), None)
    held = first.element_size() if first is not None else 4
    return {"blocks": len(blocks), "hidden": hidden, "kv_width": kv_heads * int(head_dim), "bytes": held}


def gathers_in_fp8(strategy: str) -> bool:
    """Whether tensor parallel would gather a step's blocks in fp8, from its description (the probe's
    `strategy`): torchao's tensorwise fp8 (`af.autocast_fp8` lowered to torchao, not its rowwise recipe), whose
    linears take torchao's float8 tensor-parallel styles.

    Example:
        >>> gathers_in_fp8("Step(... -> autocast_fp8(backend='auto') -> shard(ddp)  [14 Linear layers in fp8 (torchao)])")
        True
        >>> gathers_in_fp8("Step(... -> autocast_fp8(backend='torchao', recipe='rowwise') -> ...  [in fp8 (torchao)])")
        False
        >>> gathers_in_fp8("Step(... -> autocast_fp8(recipe='rowwise_with_gw_hp') -> ...  [in fp8 (torchao)])")
        False
    """
    recipe = re.search(r"recipe='(\w+)'", strategy)
    tensorwise = recipe is None or recipe.group(1) == "tensorwise"
    return "autocast_fp8(" in strategy and "fp8 (torchao)" in strategy and tensorwise


def critical_traffic(
    c: Candidate,
    decoder: dict[str, Any],
    tokens: int,
    device: DeviceSpec,
    nproc_per_node: int,
    autocast: bool = False,
    fp8_gathers: bool = False,
    script_remat: str | None = None,
) -> Traffic:
    """The tp and cp collectives a rank of `c` waits for in a step (module docstring), by link, with their
    bytes: `decoder` the probe's `decoder_shape`, `tokens` the global batch's tokens per step, `autocast` whether
    the step runs under af.autocast (activations in 16 bits), `fp8_gathers` whether tp gathers the blocks' inputs
    in fp8 (torchao's float8 styles), `script_remat` the remat a script that fixes it lowered (`c.remat` first).
    Empty without tp and cp, or without the decoder's shape."""
    from ..launch_env import remat_args

    t = Traffic()
    mesh = dict(c.mesh)
    tp, cp, pp = mesh.get("tp", 1), mesh.get("cp", 1), mesh.get("pp", 1)
    blocks, hidden = int(decoder.get("blocks", 0)), int(decoder.get("hidden", 0))
    if (tp == 1 and cp == 1) or not (blocks and hidden and tokens):
        return t
    micro = (c.accumulate or 1) * ((c.pipeline_microbatches or pp) if pp > 1 else 1)
    rows = tokens / (data_size(mesh) * cp) / micro  # a micro-batch's tokens on this rank's cp part
    act = 2 if autocast else int(decoder.get("bytes", 4))
    stage = math.ceil(blocks / pp)
    remat = c.remat if c.remat is not None else script_remat
    args: dict[str, Any] = remat_args(remat) if remat not in (None, "none") else {"policy": "", "every": 1}
    policy, every = str(args["policy"]), int(args["every"])
    again = stage // every if policy in ("full", "selective") else 0  # recomputed: blocks every, 2 every, ...

    def add(kind: str, nbytes: float, axis: str, times: int) -> None:
        t.add(kind, nbytes, (axis,), mesh, device, nproc_per_node, times * micro)

    if tp > 1:
        part = rows * hidden * (1 if fp8_gathers else act)  # the blocks' gathers (fp8 under float8 styles)
        whole = rows * hidden * act
        add("all_gather", part, "tp", 2 * stage + 2 * again)  # the parts' inputs, again where recomputed
        add("all_gather", part, "tp", 2 * stage)  # the row-wise outputs' gradients
        add("all_gather", whole, "tp", 2)  # the head's input; the embedding's output gradient
        add("reduce_scatter", whole, "tp", 4 * stage + 2 + (again if policy == "full" else 0))
    if cp > 1:
        kv = rows * cp * int(decoder.get("kv_width", hidden)) / tp * act
        add("all_gather", kv, "cp", 2 * stage + 2 * again)  # keys and values, again where recomputed
        add("reduce_scatter", kv, "cp", 2 * stage)
    return t
