"""DeepSpeed backend of `af.shard`: ZeRO stages 0-3 and ZeRO-Offload through `deepspeed.initialize`.

The step's combinators become the DeepSpeed config: `af.autocast` -> `bf16` / `fp16` (dynamic loss scale),
`af.accumulate(n)` -> `gradient_accumulation_steps`, `clip_grad_norm` (or a leading
`clip_by_global_norm` in a `chain`) -> `gradient_clipping`, and the stage from `zero_stage` (else the
user's `ds_config`, else `strategy`: "ddp" -> ZeRO-1, "fsdp" -> ZeRO-3). The optimizer's recorded
hyper-parameters (`tx.hyperparams`) build the same torch optimizer (`torch.optim.AdamW` / `Adam` / `SGD`,
`DeepSpeedCPUAdam` with optimizer offload), and a schedule becomes a `LambdaLR` stepped once per update.
A user's `ds_config` (dict or JSON path) is merged in; a key that disagrees with a combinator raises
`CompositionError` naming the key. `deepspeed` is imported only when such a step is lowered.

The step runs the engine's phases (`phases.DeepSpeedPhases`): the engine owns the backward, clipping and the
update; the batch, micro-batches, exact loss counting and metrics are the standard engine's. The state's params
are the engine module's own parameters (under ZeRO-3 the partitioned ones, with their `ds_tensor`);
`state.opt_state` is a `DeepSpeedState(count, lr)`: the optimizer's moments live inside the engine.
`af.checkpoint.save`/`load` reach them through `checkpoint.DeepSpeedStateAdapter` (full fp32 params and moments
in accelfn's own layout: the same checkpoint as the equivalent `backend="torch"` step's).

A step that raises before its update (caught by the caller) is dropped from the engine: its micro-step counter
and the ZeRO optimizer's partial gradients are reset (`abandon.drop_partial_step`), so the next step is as if it
never ran; where that fails, and after a step that raised in its update (params and moments possibly
updated), later steps raise instead of training on the leftovers.

Modules, importing one way: `types` (shared records), `abandon` <- `config`, `phases` <- `lowering` <-
`checkpoint`.
"""

from ....checkpoint import adapters as _adapters
from .checkpoint import DeepSpeedStateAdapter
from .config import build_config, config_for, make_optimizer
from .lowering import DeepSpeedSync, engine_of, lower_deepspeed
from .types import DeepSpeedRun, DeepSpeedState, Settings

__all__ = [
    "DeepSpeedState",
    "DeepSpeedRun",
    "DeepSpeedSync",
    "Settings",
    "build_config",
    "config_for",
    "engine_of",
    "lower_deepspeed",
    "make_optimizer",
]

_adapters.register(DeepSpeedState, DeepSpeedStateAdapter())
