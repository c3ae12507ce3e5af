"""Tensor parallel over the mesh's `tp` axis — lowered in its place, after the fp8 swap and before remat,
compile and FSDP/DDP (torchtitan's order), with torch's `parallelize_module`.

The plan maps module-name patterns (`*` = one name part) to styles. A Hugging Face model brings its own
(`model._tp_plan`: the config's `base_model_tp_plan` under the base model's prefix, plus the head's, e.g.
`{"model.layers.*.self_attn.q_proj": "colwise", ..., "lm_head": "colwise_gather_output"}`); any model takes a
user plan, `af.shard(step, mesh, tp_plan={...})`, whose values are style names or torch `ParallelStyle`s.

Style names (Hugging Face's, and torchtitan's meaning):
  colwise                 ColwiseParallel(): weight rows split, output stays split over the last dim
  rowwise                 RowwiseParallel(): weight columns split, input split, output summed (replicated)
  colwise_rep, colwise_gather_output
                          ColwiseParallel(output_layouts=Replicate()): output gathered
  rowwise_rep, rowwise_split_input
                          RowwiseParallel(input_layouts=Replicate()): a replicated input is split first
  embedding_rowwise       RowwiseParallel(input_layouts=Replicate()) on an nn.Embedding (vocabulary split)
  sequence_parallel       SequenceParallel(): norms/dropout on sequence shards
  replicated_with_grad_allreduce
                          a norm inside a split region (Qwen3's per-head q_norm, k_norm after a colwise
                          projection): weight replicated, input taken as split over dim 0 (the norm is row-wise,
                          so any split dim gives the same), so its weight's gradient is summed over `tp`
  replicate, gather, local_colwise, local_rowwise, ...: not supported (a clear error)

transformers' styles for MoE experts (`moe_tp_experts` on an experts module, `packed_colwise` / `packed_rowwise` on
its packed gate_up, `rowwise` on its down_proj, `moe_identity_expert`): in a model's own plan, without an `ep` axis,
its entries for the experts are left out and the experts stay whole on every tp rank (`whole_experts`; their input
is replicated, so each rank computes the same outputs and gradients); an `ep` axis splits them (`expert_parallel`).
A user plan naming these styles gets a clear error.

Parameters become DTensors in place (their names do not change: checkpoints and the state keep the Hugging
Face layout); each rank of a `tp` group reads the same batch (the data axes split it). The global gradient
norm counts every element once (`tensor_parallel_norm`), and an fp16 overflow on any shard skips the step
on every rank.
"""

from __future__ import annotations

import contextlib
import math
import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.distributed as dist
from torch import nn

from ...dtensor import local_tensor
from ...engine.contract import LOCAL, GradSync
from ...materialize import has_meta
from ...mesh import Mesh
from ...module import move
from .._base import TransformBase
from .common import max_over

if TYPE_CHECKING:
    from ...engine import Plan

__all__ = [
    "TensorParallel",
    "model_tp_plan",
    "expand_plan",
    "match_plan",
    "sequence_parallel_styles",
    "parallel_defaults",
    "DEFAULTS_KNOWN",
    "tensor_parallel_norm",
    "whole_experts",
    "EXPERT_STYLES",
]

SUPPORTED = (
    "colwise", "rowwise", "colwise_rep", "colwise_gather_output", "rowwise_rep", "rowwise_split_input",
    "embedding_rowwise", "sequence_parallel", "replicated_with_grad_allreduce",
)  # fmt: skip
# transformers' tensor-parallel styles for MoE experts, which accelfn does not split over tp (`whole_experts`)
EXPERT_STYLES = ("moe_tp_experts", "packed_colwise", "packed_rowwise", "moe_identity_expert")
# heads are split between the ranks by colwise q/k/v: the config's counts must divide
_HEAD_FIELDS = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads")


def _is_float8(module: nn.Module) -> bool:
    """A torchao Float8Linear (what `af.autocast_fp8(backend="torchao")` swapped in, lowered before TP) of the
    tensorwise recipe: torchao's float8 tensor-parallel styles cast with one scale per tensor ("currently assumes
    tensorwise scaling"); a rowwise one takes torch's styles, its collectives in its dtype (as torchtitan)."""
    if type(module).__name__ != "Float8Linear" or not type(module).__module__.startswith("torchao"):
        return False
    from torchao.float8.config import ScalingGranularity

    config: Any = module.config  # torchao's Float8LinearConfig
    return bool(config.cast_config_input.scaling_granularity is ScalingGranularity.TENSORWISE)


def _style(name: str, fp8: bool = False) -> Any:
    """torch's style for a style name; for a torchao Float8Linear, torchao's float8 versions of the same styles
    (the input is cast to float8 before its all-gather, halving that communication)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import SequenceParallel

    if fp8:
        from torchao.float8.float8_tensor_parallel import (
            Float8ColwiseParallel as ColwiseParallel,
        )
        from torchao.float8.float8_tensor_parallel import (
            Float8RowwiseParallel as RowwiseParallel,
        )
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel  # type: ignore[assignment]

    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name in ("colwise_rep", "colwise_gather_output"):
        return ColwiseParallel(output_layouts=Replicate())
    if name in ("rowwise_rep", "rowwise_split_input", "embedding_rowwise"):
        return RowwiseParallel(input_layouts=Replicate())
    if name == "sequence_parallel":
        return SequenceParallel()
    if name == "replicated_with_grad_allreduce":  # each rank's rows: its own output; the weight's grad summed
        return SequenceParallel(sequence_dim=0, use_local_output=True)
    raise ValueError(name)


def model_tp_plan(module: nn.Module) -> dict[str, str] | None:
    """A Hugging Face model's own tensor-parallel plan (full module names), or None.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                   num_attention_heads=2, num_key_value_heads=2)
        >>> model_tp_plan(LlamaForCausalLM(cfg))["model.layers.*.self_attn.o_proj"]
        'rowwise'
    """
    plan = getattr(module, "_tp_plan", None)
    if plan:
        return dict(plan)
    config = getattr(module, "config", None)
    base = getattr(config, "base_model_tp_plan", None)
    if not base:
        return None
    prefix = getattr(module, "base_model_prefix", "")
    nested = prefix and hasattr(module, prefix)
    return {(f"{prefix}.{k}" if nested else k): v for k, v in base.items()}


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(key).replace(r"\*", r"[^.]+") + "$")


def expand_plan(module: nn.Module, plan: Mapping[str, Any], tp: int) -> dict[str, Any]:
    """`{module name: ParallelStyle}` for every module a plan entry matches; checks what `tp` must divide.

    Raises ValueError naming the entry that matches no module, the style that is unknown, or the size `tp`
    does not divide.
    """

    return {
        n: _style(style, fp8=_is_float8(module.get_submodule(n))) if isinstance(style, str) else style
        for n, style in match_plan(module, plan, tp).items()
    }


def match_plan(module: nn.Module, plan: Mapping[str, Any], tp: int) -> dict[str, Any]:
    """`{module name: style name or ParallelStyle}` for every module a plan entry matches (checked as in
    `expand_plan`)."""
    from torch.distributed.tensor.parallel import ParallelStyle

    from ...stages import Skip

    # another pipeline stage's modules (stand-ins, and what is inside them) are not split here
    skipped = [n for n, m in module.named_modules() if isinstance(m, Skip)]
    every = [n for n, _ in module.named_modules() if n]
    names = [n for n in every if not any(n == s or n.startswith(s + ".") for s in skipped)]
    out: dict[str, Any] = {}
    for key, style in plan.items():
        if not isinstance(style, ParallelStyle) and style not in SUPPORTED:
            moe = (
                " (transformers' style for MoE experts: accelfn keeps the experts whole on every tp rank, or splits "
                "them over an ep axis; leave the entry out)"
                if style in EXPERT_STYLES
                else ""
            )
            raise ValueError(
                f"tp_plan[{key!r}] = {style!r} is not a style accelfn knows{moe}; use one of {list(SUPPORTED)} or "
                "a torch.distributed.tensor.parallel.ParallelStyle"
            )
        regex = _pattern(key)
        matched = [n for n in names if regex.match(n)]
        if not matched and any(regex.match(n) for n in skipped):
            continue  # the entry is for modules of another pipeline stage
        if not matched:
            near = [n for n in names if n.rsplit(".", 1)[-1] == key.rsplit(".", 1)[-1]][:3]
            hint = f"; modules with that last name: {near}" if near else f"; some module names: {names[:6]}"
            raise ValueError(f"tp_plan entry {key!r} matches no module of the model{hint}")
        for n in matched:
            sub = module.get_submodule(n)
            if not isinstance(style, ParallelStyle):
                _check_divisible(n, sub, style, tp)
            out[n] = style
    _check_heads(module, tp)
    return out


SP_LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")


def sequence_parallel_styles(
    module: nn.Module, named: dict[str, Any], loss_parallel: bool, fp8_gather: bool = True
) -> dict[str, Any]:
    """torchtitan's sequence parallel for a Hugging Face decoder (Llama, Mistral, Qwen2, Starcoder2, ...): the
    residual stream between the tensor-parallel regions stays split over the sequence (a DTensor `Shard(1)`),
    so norms (and dropout) run on `seq / tp` tokens per rank and activations take `1 / tp` of the memory; the
    attention and the MLP gather the sequence at their input, their row-wise output layers scatter it again.
    torchao's fp8 linears (`af.autocast_fp8`) take torchao's float8 styles, which gather the sequence in fp8
    (`fp8_gather`; False: torch's styles, for gloo, which has no fp8 collectives).
    A pipeline stage's styles are those of its own modules. `named` is `match_plan`'s result (style names);
    returns `{module name: ParallelStyle}`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    from ...stages import Skip
    from ..remat import find_remat_blocks

    def name_of(target: nn.Module | None) -> str | None:
        return (
            next((n for n, m in module.named_modules() if m is target), None) if target is not None else None
        )

    get_in, get_out = (
        getattr(module, "get_input_embeddings", None),
        getattr(module, "get_output_embeddings", None),
    )
    embed = name_of(get_in()) if callable(get_in) else None
    head = name_of(get_out()) if callable(get_out) else None
    base = getattr(module, getattr(module, "base_model_prefix", ""), module)
    norm = name_of(getattr(base, "norm", None))
    _, layers = find_remat_blocks(module)
    layer_names = [name_of(layer) for layer in layers]
    missing = [p for p in SP_LAYER_PARTS if not all(hasattr(layer, p) for layer in layers)]
    if embed is None or head is None or norm is None or missing or None in layer_names:
        raise ValueError(
            "shard(sequence_parallel=True) knows Hugging Face decoders whose layers have "
            f"{list(SP_LAYER_PARTS)} and whose base model has `norm` ({type(module).__name__}: missing "
            f"{missing or 'the embeddings, head or final norm'}); pass a user tp_plan with 'sequence_parallel' "
            "entries and torch styles instead"
        )

    def fp8(name: str) -> bool:  # (on gloo torch's styles: torchao's run fp8 collectives in the backward too)
        return fp8_gather and _is_float8(module.get_submodule(name))

    def prepare(part: str, **layouts: Any) -> Any:  # a region's input gathered (in fp8 if its linears are)
        if any(fp8(n) for n in named if n.startswith(f"{part}.")):
            from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

            return PrepareFloat8ModuleInput(**layouts)
        return PrepareModuleInput(**layouts)

    def here(name: str) -> bool:  # not a stand-in for another pipeline stage's module
        return not isinstance(module.get_submodule(name), Skip)

    styles = {n: _style(st, fp8=fp8(n)) if isinstance(st, str) else st for n, st in named.items()}
    if here(embed):
        styles[embed] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        )
    if here(norm):
        styles[norm] = SequenceParallel()
    if here(head):
        styles[head] = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )

    def split_whole(part: str) -> bool:  # every module of `part` with parameters of its own is in the plan
        return all(
            n in named or any(n.startswith(f"{k}.") for k in named)
            for n, m in module.get_submodule(part).named_modules(prefix=part)
            if next(m.parameters(recurse=False), None) is not None
        )

    whole_parts = []  # parts with compute the plan leaves whole: they see the whole sequence, plain tensors
    for layer in layer_names:
        assert layer is not None
        styles[f"{layer}.input_layernorm"] = SequenceParallel()
        styles[f"{layer}.post_attention_layernorm"] = SequenceParallel()
        for part, kwarg in ((f"{layer}.self_attn", True), (f"{layer}.mlp", False)):
            gather: dict[str, Any] = (  # the sequence gathered at the part's input
                {"input_kwarg_layouts": {"hidden_states": Shard(1)},
                 "desired_input_kwarg_layouts": {"hidden_states": Replicate()}}
                if kwarg  # (the attention takes it by keyword)
                else {"input_layouts": (Shard(1),), "desired_input_layouts": (Replicate(),)}
            )  # fmt: skip
            if split_whole(part):  # its row-wise layers scatter the sequence (below)
                styles[part] = prepare(part, **gather)
                continue
            # compute the plan leaves whole (an MoE block's router and whole experts beside split shared experts,
            # an attention without entries): the sequence gathered in as a plain tensor, the output scattered (the
            # attention's output: its own and its weights; the 2nd desired layout unused where its layout is None)
            whole_parts.append(part)
            out, scattered = (
                ((Replicate(), None), (Shard(1), Shard(1))) if kwarg else ((Replicate(),), (Shard(1),))
            )
            styles[part] = PrepareModuleInputOutput(
                **gather, use_local_input=True, output_layouts=out, desired_output_layouts=scattered,
                use_local_output=False,
            )  # fmt: skip
        for n, st in named.items():  # the row-wise layers of the attention and the MLP scatter the sequence
            if any(n.startswith(f"{p}.") for p in whole_parts):
                continue  # (their output summed and plain: the part's wrapper scatters it)
            if n.startswith(f"{layer}.") and st in ("rowwise", "rowwise_rep", "rowwise_split_input"):
                if fp8(n):
                    from torchao.float8.float8_tensor_parallel import Float8RowwiseParallel

                    styles[n] = Float8RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
                else:
                    styles[n] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return styles


def _present(module: nn.Module, raw: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    """A model's own plan without the entries that name no module or parameter of this model (a family's plan
    covers all its configs: Qwen3-MoE's has dense-MLP entries for `mlp_only_layers`), said in `notes`. A user's
    plan is not filtered: an entry of it that matches nothing is an error."""
    from ...stages import Skip

    names = [n for n, _ in module.named_modules() if n] + [n for n, _ in module.named_parameters()]
    skipped = [n for n, m in module.named_modules() if isinstance(m, Skip)]
    absent = [k for k in raw if not any(_pattern(k).match(n) for n in names + skipped)]
    if (
        absent and len(absent) == len(raw) and not skipped
    ):  # (a pipeline stage may hold nothing the plan splits)
        raise ValueError(
            f"shard: the tp plan {type(module).__name__} brings ({len(raw)} entries, e.g. {absent[0]!r}) names none "
            f"of its modules (they are named like {names[:3]}): tensor parallel would split nothing. A wrapper "
            "around the model renames them; shard the model itself, or pass tp_plan= with these names"
        )
    if absent:
        notes.append(f"the model's tp plan entries for modules it does not have, left out: {absent}")
    return {k: v for k, v in raw.items() if k not in absent}


def whole_experts(module: nn.Module, raw: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    """A model's own plan without its entries for MoE experts: those with a style of `EXPERT_STYLES`, and those
    matching only what is inside a `moe_tp_experts` module (its `down_proj`'s `rowwise`); said in `notes`. The
    experts then stay whole on every tp rank: their input (after the attention's row-wise projection) and the
    router's choices are replicated, so each rank computes the same outputs and gradients.

    Example:
        >>> from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        >>> cfg = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        ...                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, num_experts=4)
        >>> model = Qwen3MoeForCausalLM(cfg)
        >>> plan = whole_experts(model, model_tp_plan(model), notes := [])
        >>> sorted(k for k in model_tp_plan(model) if k not in plan)
        ['model.layers.*.mlp.experts', 'model.layers.*.mlp.experts.down_proj', 'model.layers.*.mlp.experts.gate_up_proj']
    """
    modules = [n for n, _ in module.named_modules() if n]
    names = modules + [n for n, _ in module.named_parameters()]
    owners = [n for k, v in raw.items() if v == "moe_tp_experts" for n in modules if _pattern(k).match(n)]

    def experts(key: str) -> bool:
        hits = [n for n in names if _pattern(key).match(n)]
        return bool(hits) and all(any(n == o or n.startswith(o + ".") for o in owners) for n in hits)

    dropped = [k for k, v in raw.items() if (isinstance(v, str) and v in EXPERT_STYLES) or experts(k)]
    if dropped:
        notes.append(
            f"the experts stay whole on every tp rank (replicated over tp: each computes the same outputs; an ep "
            f"axis splits them), the model's tp plan entries for them left out: {dropped}"
        )
    return {k: v for k, v in raw.items() if k not in dropped}


def _check_model_styles(module: nn.Module, raw: Mapping[str, Any]) -> None:
    """A model's own plan (after `whole_experts`) uses only styles accelfn knows; else a ValueError naming the
    entry, the style and the way out (a user plan)."""
    unknown = {k: v for k, v in raw.items() if isinstance(v, str) and v not in SUPPORTED}
    if unknown:
        key, style = next(iter(unknown.items()))
        raise ValueError(
            f"{type(module).__name__}'s own tp plan (config.base_model_tp_plan) maps {key!r} to {style!r}, a style "
            f"accelfn does not know (every such entry: {sorted(unknown)}); pass af.shard(..., tp_plan="
            f"{{...}}) with styles of {list(SUPPORTED)} or torch ParallelStyles, or a mesh without tp"
        )


def _check_divisible(name: str, sub: nn.Module, style: str, tp: int) -> None:
    if style in ("sequence_parallel", "replicated_with_grad_allreduce"):
        return
    if isinstance(sub, nn.Embedding):
        size, what = sub.num_embeddings, "num_embeddings"
        if style.startswith("colwise"):
            size, what = sub.embedding_dim, "embedding_dim"
    elif isinstance(sub, nn.Linear):
        size, what = (
            (sub.out_features, "out_features")
            if style.startswith("colwise")
            else (sub.in_features, "in_features")
        )
    else:
        raise ValueError(
            f"tp_plan: module {name!r} is a {type(sub).__name__}; the style {style!r} splits nn.Linear and "
            "nn.Embedding only (pass a torch ParallelStyle for other modules)"
        )
    if size % tp:
        raise ValueError(f"tp={tp} does not divide {name}.{what} = {size} (style {style!r})")


def _check_heads(module: nn.Module, tp: int) -> None:
    config = getattr(module, "config", None)
    for field in _HEAD_FIELDS:
        n = getattr(config, field, None)
        if isinstance(n, int) and n % tp:
            raise ValueError(
                f"tp={tp} does not divide the model's {field} = {n} (config): each rank takes whole heads"
            )


def _tied_groups(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Parameters shared by several modules (tied embeddings): [(owner, attribute name), ...] per shared one."""
    seen: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in module.modules():
        for attr, p in m._parameters.items():
            if p is not None:
                seen.setdefault(id(p), []).append((m, attr))
    return [owners for owners in seen.values() if len(owners) > 1]


def _retie(groups: list[list[tuple[nn.Module, str]]]) -> None:
    """`parallelize_module` replaces each module's parameters: share them again where they were shared."""
    for owners in groups:
        first_m, first_a = owners[0]
        p = first_m._parameters[first_a]
        for m, a in owners[1:]:
            q = m._parameters[a]
            if q is p:
                continue
            if getattr(q, "placements", None) != getattr(p, "placements", None):
                raise ValueError(
                    f"tp_plan splits the tied parameters {type(first_m).__name__}.{first_a} and "
                    f"{type(m).__name__}.{a} differently ({getattr(p, 'placements', 'not split')} vs "
                    f"{getattr(q, 'placements', 'not split')}): untie them or give them the same style"
                )
            m._parameters[a] = p


# The `transformers` decoders (config.model_type) whose sequence parallel and loss parallel are tested equal to one
# process (tests/test_tensor_parallel.py): for them a tp axis does both by default, as torchtitan does.
DEFAULTS_KNOWN: frozenset[str] = frozenset({"llama", "mistral", "qwen2", "starcoder2"})


def parallel_defaults(module: nn.Module, user_plan: bool) -> str | None:
    """Why sequence and loss parallel do not apply to `module` by default (None: they do): they are on by default
    for a `transformers` causal LM of `DEFAULTS_KNOWN` under its own plan (whole, or a pipeline stage of it, as
    torchtitan runs its stages), with its output layer an `nn.Linear`.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                   num_attention_heads=2, num_key_value_heads=2)
        >>> parallel_defaults(LlamaForCausalLM(cfg), user_plan=False) is None
        True
        >>> parallel_defaults(LlamaForCausalLM(cfg), user_plan=True)
        'a user tp_plan'
    """
    from ...stages import Skip

    model_type = getattr(getattr(module, "config", None), "model_type", None)
    if user_plan:
        return "a user tp_plan"
    if model_type not in DEFAULTS_KNOWN:
        return f"{type(module).__name__} is not a transformers decoder they are tested on ({sorted(DEFAULTS_KNOWN)})"
    get = getattr(module, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, Skip):  # another pipeline stage's head: what it stands for
        head = nn.Linear(1, 1, device="meta") if head.stands_for == "Linear" else None
    if not isinstance(head, nn.Linear):
        return f"{type(module).__name__} has no nn.Linear output layer"
    return None


@contextlib.contextmanager
def _loss_parallel_by_default() -> Any:
    """Name the default on an error in the forward or the loss (which now receives vocabulary shards)."""
    try:
        yield
    except Exception as e:
        e.add_note(
            "shard(): loss_parallel is on by default for this model: the loss function receives the logits split "
            "over the vocabulary (a DTensor, Shard(-1)), which af.losses.cross_entropy and F.cross_entropy take. "
            "If the error comes from the loss using the logits otherwise, pass af.shard(..., loss_parallel=False) "
            "(or call .full_tensor() on them)"
        )
        raise


@attrs.frozen(eq=False)
class TensorParallel(TransformBase):
    mesh: Mesh
    plan: tuple[tuple[str, Any], ...] | None = None
    loss_parallel: bool | None = None  # None: on where `parallel_defaults` says it applies
    sequence_parallel: bool | None = None
    kind: str = "tensor_parallel"

    @property
    def size(self) -> int:
        return self.mesh.axis_size("tp")

    def describe(self) -> str:
        extra = (", user plan" if self.plan is not None else "") + (
            ", loss_parallel" if self.loss_parallel else ""
        )
        extra += ", sequence_parallel" if self.sequence_parallel else ""
        extra += ", no loss_parallel" if self.loss_parallel is False else ""
        extra += ", no sequence_parallel" if self.sequence_parallel is False else ""
        return f"tensor_parallel(tp={self.size}{extra})"

    def lower(self, plan: Plan) -> None:
        module = plan.module
        if any(getattr(p, "placements", None) is not None for p in module.parameters()):
            plan.notes.append(f"tp={self.size} (already parallelized)")
            return  # initialised again, or an eval step on the training step's module
        from torch.distributed.tensor.parallel import parallelize_module

        peft = sys.modules.get("peft")
        if self.plan is None and peft is not None and isinstance(module, peft.PeftModel):
            raise ValueError(
                f"shard: tensor parallel (tp={self.size}) of a PEFT model by its own plan is not supported: its LoRA "
                "layers wrap the "
                "Linear layers a tp plan splits (lora.Linear's base_layer), and the base model's plan names them "
                "without PeftModel's 'base_model.model.' prefix. Train the adapter over a data-parallel mesh (dp, or "
                "fsdp: af.shard(step, af.Mesh({'dp': N}), strategy='fsdp')), or pass tp_plan= naming modules LoRA "
                "does not wrap"
            )
        source = "user plan"
        raw: Mapping[str, Any] | None = dict(self.plan) if self.plan is not None else None
        if raw is None:
            raw = model_tp_plan(module)
            source = "the model's own plan"
            if raw is None:
                raise ValueError(
                    f"shard: the mesh has a tp axis (tp={self.size}) but {type(module).__name__} brings no tensor-"
                    "parallel plan (Hugging Face models do: config.base_model_tp_plan); pass tp_plan={'layers.*.attn."
                    "q': 'colwise', ...}"
                )
            raw = _present(module, raw, plan.notes)
        ep = next((t for t in plan.transforms if t.kind == "expert_parallel"), None)
        if ep is not None:  # the experts follow the ep plan, whatever the tp plan says of them
            raw = ep.without_experts(module, raw, plan.notes)
        if self.plan is None:  # (at ep=1: the model's plan's experts stay whole on every tp rank)
            raw = whole_experts(module, raw, plan.notes)
            _check_model_styles(module, raw)
        why_not = None
        if self.sequence_parallel is None or self.loss_parallel is None:
            why_not = parallel_defaults(module, user_plan=self.plan is not None)
        sp = self.sequence_parallel if self.sequence_parallel is not None else why_not is None
        lp = self.loss_parallel if self.loss_parallel is not None else why_not is None
        gloo = dist.get_backend(self.mesh.group("tp")) == "gloo"
        if why_not is not None:
            plan.notes.append(f"sequence and loss parallel not on by default: {why_not}")
        elif self.sequence_parallel is None and gloo and any(_is_float8(m) for m in module.modules()):
            sp = False  # torchao's float8 styles, which sequence parallel needs, run fp8 collectives
            plan.notes.append(
                "sequence parallel not on by default under autocast_fp8 on gloo (no fp8 collectives)"
            )
        if sp:
            styles = sequence_parallel_styles(module, match_plan(module, raw, self.size), lp, not gloo)
            default = (
                " (the default: sequence_parallel=False turns it off)"
                if self.sequence_parallel is None
                else ""
            )
            plan.notes.append(f"sequence parallel between the tensor-parallel regions{default}")
        else:
            styles = expand_plan(module, raw, self.size)
        if lp:
            head = self._vocabulary_parallel_head(module, styles, keep=sp)
            from torch.distributed.tensor.parallel import loss_parallel

            if self.loss_parallel is None:
                plan.forward_contexts.append(_loss_parallel_by_default)
            plan.forward_contexts.append(loss_parallel)
            plan.backward_contexts.append(loss_parallel)
            default = " (the default: loss_parallel=False turns it off)" if self.loss_parallel is None else ""
            plan.notes.append(f"loss on vocabulary shards ({head}){default}")
        if not has_meta(module):  # built on the meta device: stays there until sharded (see materialize)
            move(module, self.mesh.device)
        fp8 = [n for n, st in styles.items() if type(st).__name__.startswith("Float8")]
        if fp8:
            plan.notes.append(f"float8 tensor-parallel styles (torchao) on {len(fp8)} modules")
        tied = _tied_groups(module)
        parallelize_module(module, self.mesh.submesh("tp"), styles)
        _retie(tied)
        if sp:  # what a pipeline stage hands the next: this rank's part of the sequence (torchtitan's stages)
            from torch.distributed.tensor import Shard

            module._accelfn_residual_layout = (self.mesh.submesh("tp"), (Shard(1),))  # type: ignore[assignment]
        plan.notes.append(f"tensor parallel tp={self.size} on {len(styles)} modules ({source})")

    @staticmethod
    def _vocabulary_parallel_head(module: nn.Module, styles: dict[str, Any], keep: bool = False) -> str:
        """Make the output layer leave its logits split over the vocabulary (a DTensor `Shard(-1)`), for the
        loss to run on the shards (torch's `loss_parallel`); its name."""
        from torch.distributed.tensor.parallel import ColwiseParallel

        from ...stages import Skip

        get = getattr(module, "get_output_embeddings", None)
        head = get() if callable(get) else None
        if head is None:  # not a Hugging Face model: the user's plan leaves the logits split itself
            return "the user plan's output layer"
        name = next(n for n, m in module.named_modules() if m is head)
        if isinstance(head, Skip):  # the head is on another pipeline stage
            return name
        if name not in styles or not isinstance(head, nn.Linear):
            raise ValueError(
                f"shard(loss_parallel=True): the output layer {name!r} must be split by the tensor-parallel plan "
                f"(an nn.Linear with a colwise style); the plan splits {sorted(styles)[:4]}..."
            )
        if not keep:  # (sequence parallel has set the head's style already)
            styles[name] = ColwiseParallel(use_local_output=False)  # logits stay split: Shard(-1)
        return name


def _shards(t: torch.Tensor) -> int:
    """Into how many distinct pieces a tensor is split over the ranks (1: every rank holds all of it)."""
    placements = getattr(t, "placements", None)
    if placements is None:
        return 1
    mesh = t.device_mesh  # type: ignore[attr-defined]
    return math.prod(mesh.size(i) for i, p in enumerate(placements) if _splits(p))


def _splits(placement: Any) -> bool:
    """Shard, or FSDP-over-TP's `_StridedShard` (which is not a `Shard` subclass in recent torch)."""
    return bool(placement.is_shard()) or type(placement).__name__ == "_StridedShard"


def tensor_parallel_norm(grads: list[torch.Tensor], world: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The global L2 norm of tensors split any way over the ranks (TP, FSDP, both, or replicated): each rank's
    local squares weighted by (pieces / ranks), summed over the world in one all-reduce."""
    if not grads:
        return torch.zeros(())
    ranks = dist.get_world_size(world)
    local = [local_tensor(g) for g in grads]
    norms = torch._foreach_norm(local)
    weights = torch.tensor([_shards(g) / ranks for g in grads], dtype=torch.float32, device=local[0].device)
    sq = (torch.stack([n.float() for n in norms]) ** 2 * weights).sum()
    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=world)
    return sq.sqrt()


@attrs.define(eq=False)
class TensorParallelSync(GradSync):
    """The gradient sync under tensor parallel: the data-parallel one (`inner`, or none when the mesh has no
    data axis) for the sums; the norm and the overflow check over every rank, since each holds other shards."""

    inner: GradSync = (
        LOCAL  # the data-parallel strategy's (LOCAL: tp ranks read the same batch, nothing to sum)
    )

    def prepare(self, params: dict[str, torch.Tensor]) -> None:
        self.inner.prepare(params)

    def microbatch(self, last: bool) -> contextlib.AbstractContextManager[Any]:
        return self.inner.microbatch(last)

    def record_unused(self, names: tuple[str, ...], missing: set[str]) -> None:
        self.inner.record_unused(names, missing)

    def abandon(self) -> None:
        self.inner.abandon()

    def reduce(
        self, grads: list[torch.Tensor], loss_sum: torch.Tensor, count: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.reduce(grads, loss_sum, count)

    def norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return tensor_parallel_norm(grads)

    def describe(self) -> str:
        inner = "" if self.inner is LOCAL else f"; {self.inner.describe()}"
        return f"tensor parallel (norm and overflow over all ranks){inner}"

    def reduce_metrics(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.inner.reduce_metrics(values)

    def after_update(self, params: dict[str, torch.Tensor], step: torch.Tensor) -> None:
        self.inner.after_update(params, step)

    def any_rank(self, flag: torch.Tensor) -> torch.Tensor:
        return max_over(flag, None)

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        return max_over(x, None)
