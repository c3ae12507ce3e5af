"""The launcher -> worker contract: every setting `accelfn launch` passes to a script, as env variables.

This is the only place the names are written down. It imports nothing from torch or the launcher, so
core modules (``Mesh.from_env``, the combinators) can read it. torch's elastic agent adds its own
variables too (RANK, WORLD_SIZE, LOCAL_RANK, ...), read here as well.

Example:
    >>> e = read_env({"ACCELFN_MESH": "dp=-1,tp=2", "ACCELFN_MIXED_PRECISION": "bf16", "WORLD_SIZE": "4"})
    >>> e.mesh, e.mixed_precision, e.world_size
    ({'dp': -1, 'tp': 2}, 'bf16', 4)
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import attrs

# Set by `accelfn launch` (absent: the script runs as a plain single process, defaults apply).
ACCELFN_LAUNCHED = "ACCELFN_LAUNCHED"  # "1" in every process started by `accelfn launch`
ACCELFN_DEVICE = "ACCELFN_DEVICE"  # device kind: cpu|cuda|xla|xpu|npu|mlu ("auto" / unset: detect)
ACCELFN_MESH = "ACCELFN_MESH"  # mesh axes "dp=2,tp=1"; -1 = the rest of the world
ACCELFN_MIXED_PRECISION = "ACCELFN_MIXED_PRECISION"  # no|bf16|fp16|fp8
ACCELFN_FP8_BACKEND = "ACCELFN_FP8_BACKEND"  # auto|torchao|te (only with mixed precision fp8)
ACCELFN_FP8_RECIPE = "ACCELFN_FP8_RECIPE"  # backend-specific recipe name, e.g. "tensorwise"
ACCELFN_CONFIG_FILE = "ACCELFN_CONFIG_FILE"  # the YAML config the launcher used, if any
ACCELFN_LOG_WITH = "ACCELFN_LOG_WITH"  # experiment trackers "tensorboard,jsonl" or "none" (accelfn.trackers)
# The planner's knobs (`accelfn plan --write`, a config's `plan:` section): read by a script through `knob`
# where it leaves the choice to the launch configuration ("auto"); absent: the script's default applies.
ACCELFN_STRATEGY = "ACCELFN_STRATEGY"  # af.shard's strategy: ddp|fsdp|hsdp|zero1|zero2|zero3
ACCELFN_REMAT = "ACCELFN_REMAT"  # activation checkpointing: none|selective|full|full:2|selective:2 ...
ACCELFN_ACCUMULATE = "ACCELFN_ACCUMULATE"  # micro-batches per step (af.accumulate)
ACCELFN_GLOBAL_BATCH_SIZE = "ACCELFN_GLOBAL_BATCH_SIZE"  # samples per step over all data-parallel ranks
ACCELFN_PIPELINE_SCHEDULE = "ACCELFN_PIPELINE_SCHEDULE"  # af.pipeline's schedule, e.g. 1f1b
ACCELFN_PIPELINE_MICROBATCHES = "ACCELFN_PIPELINE_MICROBATCHES"  # af.pipeline's micro-batches per step
# af.pipeline's sync_each_microbatch (fsdp/hsdp: reduce-scatter each micro-batch's gradients): true|false
ACCELFN_PIPELINE_SYNC_EACH_MICROBATCH = "ACCELFN_PIPELINE_SYNC_EACH_MICROBATCH"
ACCELFN_OFFLOAD = "ACCELFN_OFFLOAD"  # af.offload: none|optimizer
ACCELFN_COMPILE = "ACCELFN_COMPILE"  # af.compile: none|step|blocks

# Set by torch's elastic agent (torch.distributed.run semantics), read here for convenience.
RANK = "RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_RANK = "LOCAL_RANK"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"  # the node's rank
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"

ACCELFN_VARIABLES = (
    ACCELFN_LAUNCHED,
    ACCELFN_DEVICE,
    ACCELFN_MESH,
    ACCELFN_MIXED_PRECISION,
    ACCELFN_FP8_BACKEND,
    ACCELFN_FP8_RECIPE,
    ACCELFN_CONFIG_FILE,
    ACCELFN_LOG_WITH,
    ACCELFN_STRATEGY,
    ACCELFN_REMAT,
    ACCELFN_ACCUMULATE,
    ACCELFN_GLOBAL_BATCH_SIZE,
    ACCELFN_PIPELINE_SCHEDULE,
    ACCELFN_PIPELINE_MICROBATCHES,
    ACCELFN_PIPELINE_SYNC_EACH_MICROBATCH,
    ACCELFN_OFFLOAD,
    ACCELFN_COMPILE,
)

DEVICE_KINDS = ("auto", "cpu", "cuda", "xla", "xpu", "npu", "mlu")
MIXED_PRECISION = ("no", "bf16", "fp16", "fp8")
FP8_BACKENDS = ("auto", "torchao", "te")
# accelfn.trackers.BACKENDS; "all" (every installed one) is resolved where the script runs
TRACKERS = (
    "jsonl",
    "tensorboard",
    "wandb",
    "mlflow",
    "trackio",
    "comet_ml",
    "aim",
    "clearml",
    "dvclive",
    "swanlab",
)
# The usual axis names, for messages (any identifier is accepted).
MESH_AXES = ("dp", "dp_replicate", "dp_shard", "fsdp", "tp", "pp", "cp", "ep")


def parse_mesh(spec: str, *, source: str = ACCELFN_MESH) -> dict[str, int]:
    """Parse ``"dp=2,tp=1"`` into ``{"dp": 2, "tp": 1}``; ``source`` names the culprit in errors.

    Example:
        >>> parse_mesh("fsdp=-1, tp=2")
        {'fsdp': -1, 'tp': 2}
    """
    axes: dict[str, int] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, sep, size = part.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier():
            raise ValueError(
                f"{source}={spec!r}: {part!r} is not AXIS=SIZE with AXIS a name such as {', '.join(MESH_AXES)}"
            )
        try:
            n = int(size)
        except ValueError:
            raise ValueError(
                f"{source}={spec!r}: size of axis {name!r} must be an integer, got {size!r}"
            ) from None
        if n == 0 or n < -1:
            raise ValueError(
                f"{source}={spec!r}: size of axis {name!r} must be >= 1 or -1 (the rest), got {n}"
            )
        if name in axes:
            raise ValueError(f"{source}={spec!r}: axis {name!r} is given twice")
        axes[name] = n
    if sum(1 for n in axes.values() if n == -1) > 1:
        raise ValueError(f"{source}={spec!r}: at most one axis may be -1")
    return axes


def format_mesh(axes: Mapping[str, int]) -> str:
    """The inverse of `parse_mesh`: ``{"dp": 2, "tp": 1}`` -> ``"dp=2,tp=1"``."""
    return ",".join(f"{k}={v}" for k, v in axes.items())


def parse_log_with(spec: str, *, source: str = ACCELFN_LOG_WITH) -> tuple[str, ...]:
    """Parse ``"tensorboard, jsonl"`` into tracker names (``"none"``: no tracker; ``"all"``: every tracker
    installed where the script runs, kept as the name ``"all"``); ``source`` names the culprit.

    Example:
        >>> parse_log_with("TensorBoard,jsonl"), parse_log_with("none"), parse_log_with("all")
        (('tensorboard', 'jsonl'), (), ('all',))
    """
    names: list[str] = []
    for name in (p.strip().lower() for p in spec.split(",")):
        if name and name not in names:
            names.append(name)
    for name in names:
        if name not in (*TRACKERS, "all", "none"):
            raise ValueError(
                f"{source}={spec!r}: unknown tracker {name!r}; known: {', '.join(TRACKERS)}, all, none"
            )
    if "none" in names:
        if len(names) > 1:
            raise ValueError(f"{source}={spec!r}: 'none' cannot be combined with other trackers")
        return ()
    return tuple(names)


def _choice(env: Mapping[str, str], name: str, allowed: tuple[str, ...], default: str) -> str:
    value = env.get(name, "").strip().lower() or default
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of {', '.join(allowed)}")
    return value


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer") from None


@attrs.frozen
class LaunchEnv:
    """What a worker process was told by the launcher (or the defaults of a plain single process)."""

    launched: bool
    device: str
    mesh: dict[str, int] | None
    mixed_precision: str
    fp8_backend: str
    fp8_recipe: str | None
    config_file: str | None
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    restart_count: int
    log_with: tuple[str, ...] | None = None  # None: not set (the script's own choice applies)


def read_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read and validate the contract from ``environ`` (default: ``os.environ``).

    Example:
        >>> read_env({}).world_size, read_env({}).device
        (1, 'auto')
    """
    env = os.environ if environ is None else environ
    mesh_spec = env.get(ACCELFN_MESH, "").strip()
    log_with = env.get(ACCELFN_LOG_WITH, "").strip()
    return LaunchEnv(
        launched=env.get(ACCELFN_LAUNCHED, "") == "1",
        device=_choice(env, ACCELFN_DEVICE, DEVICE_KINDS, "auto"),
        mesh=parse_mesh(mesh_spec) if mesh_spec else None,
        mixed_precision=_choice(env, ACCELFN_MIXED_PRECISION, MIXED_PRECISION, "no"),
        fp8_backend=_choice(env, ACCELFN_FP8_BACKEND, FP8_BACKENDS, "auto"),
        fp8_recipe=env.get(ACCELFN_FP8_RECIPE) or None,
        config_file=env.get(ACCELFN_CONFIG_FILE) or None,
        rank=_int(env, RANK, 0),
        world_size=_int(env, WORLD_SIZE, 1),
        local_rank=_int(env, LOCAL_RANK, 0),
        local_world_size=_int(env, LOCAL_WORLD_SIZE, 1),
        node_rank=_int(env, GROUP_RANK, 0),
        restart_count=_int(env, RESTART_COUNT, 0),
        log_with=parse_log_with(log_with) if log_with else None,
    )


# The knobs a script may leave to the launch configuration: name -> (variable, allowed values or int).
# af.shard's strategies; zero1-3: DeepSpeed ZeRO stages 1-3 (af.shard(strategy="zero2") = backend="deepspeed",
# zero_stage=2), so that a script passing the knob to af.shard runs them unchanged
STRATEGIES = ("ddp", "fsdp", "hsdp", "zero1", "zero2", "zero3")
# the remat policies; POLICY:N (e.g. "full:2") checkpoints every n-th block only (`parse_remat`)
REMAT = ("none", "selective", "full")
OFFLOAD = ("none", "optimizer")
COMPILE = ("none", "step", "blocks")  # af.compile(step) / af.compile(step, regions="blocks")
KNOBS: dict[str, tuple[str, tuple[str, ...] | type]] = {
    "strategy": (ACCELFN_STRATEGY, STRATEGIES),
    "remat": (ACCELFN_REMAT, REMAT),
    "accumulate": (ACCELFN_ACCUMULATE, int),
    "global_batch_size": (ACCELFN_GLOBAL_BATCH_SIZE, int),
    "pipeline_schedule": (ACCELFN_PIPELINE_SCHEDULE, str),
    "pipeline_microbatches": (ACCELFN_PIPELINE_MICROBATCHES, int),
    "pipeline_sync_each_microbatch": (ACCELFN_PIPELINE_SYNC_EACH_MICROBATCH, bool),
    "offload": (ACCELFN_OFFLOAD, OFFLOAD),
    "compile": (ACCELFN_COMPILE, COMPILE),
}
# The knobs scripts asked for with "auto" in this process (what `accelfn plan` may choose for them).
ASKED: set[str] = set()
# The values scripts fixed for knobs in this process (not "auto": what `accelfn plan` keeps), by knob.
FIXED: dict[str, Any] = {}


def parse_knob(name: str, raw: str | int, *, source: str | None = None) -> str | int:
    """A knob's value from its text (an int for the counts, a bool for true|false; remat as `parse_remat`),
    checked; `source` names the culprit in errors.

    Example:
        >>> parse_knob("accumulate", "4"), parse_knob("remat", "selective"), parse_knob("remat", "full:2")
        (4, 'selective', 'full:2')
    """
    if name not in KNOBS:
        raise ValueError(f"unknown knob {name!r}; knobs: {', '.join(KNOBS)}")
    var, allowed = KNOBS[name]
    where = source or var
    if allowed is bool:  # true|false (YAML's booleans, str(bool) as the launcher passes them, 1|0, yes|no)
        word = str(raw).strip().lower()
        if word in ("true", "1", "yes", "on"):
            return True
        if word in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{where}={raw!r} must be true or false")
    if allowed is int:
        try:
            n = int(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{where}={raw!r} must be an integer >= 1") from None
        if isinstance(raw, bool) or n < 1:
            raise ValueError(f"{where}={raw!r} must be an integer >= 1")
        return n
    text = str(raw).strip().lower() if allowed is not str else str(raw).strip()
    if name == "remat":
        return parse_remat(text, source=where, raw=raw)
    if isinstance(allowed, tuple) and text not in allowed:
        raise ValueError(f"{where}={raw!r} is not one of {', '.join(allowed)}")
    if not text:
        raise ValueError(f"{where}={raw!r} must not be empty")
    return text


def parse_remat(text: str, *, source: str = ACCELFN_REMAT, raw: Any = None) -> str:
    """The `remat` knob's value, canonical: a policy of `REMAT`, or ``POLICY:N`` (selective or full on every
    n-th block only, blocks n, 2n, ... as `af.remat(step, POLICY, every=N)`; ``POLICY:1`` is ``POLICY``);
    `source` names the culprit in errors.

    Example:
        >>> parse_remat("Full:2"), parse_remat("selective:1"), parse_remat("none")
        ('full:2', 'selective', 'none')
    """
    shown = text if raw is None else raw
    policy, sep, every = str(text).strip().lower().partition(":")
    policy = policy.strip()
    if policy not in REMAT:
        raise ValueError(
            f"{source}={shown!r} is not one of {', '.join(REMAT)}, or POLICY:N (selective or full on every "
            "n-th block, e.g. full:2)"
        )
    if not sep:
        return policy
    if policy == "none":
        raise ValueError(
            f"{source}={shown!r}: 'none' checkpoints no block; every n-th block needs selective or full"
        )
    try:
        n = int(every)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(
            f"{source}={shown!r}: the block interval {every.strip()!r} must be an integer >= 1 "
            f"(e.g. {policy}:2 checkpoints blocks 2, 4, 6, ...)"
        )
    return policy if n == 1 else f"{policy}:{n}"


def remat_args(value: str) -> dict[str, Any]:
    """`af.remat`'s arguments for a `remat` knob value other than "none": ``af.remat(step, **remat_args(v))``.

    Example:
        >>> remat_args("full:2"), remat_args("selective")
        ({'policy': 'full', 'every': 2}, {'policy': 'selective', 'every': 1})
    """
    text = parse_remat(value, source="remat")
    if text == "none":
        raise ValueError("remat_args('none'): remat 'none' checkpoints nothing; do not apply af.remat")
    policy, _, every = text.partition(":")
    return {"policy": policy, "every": int(every or 1)}


def remat_flag(text: str) -> str:
    """An argparse `type` for a script's `--remat` flag: "auto" (the launch configuration's) or a remat value,
    checked and canonical; a bad one is argparse's usage error, naming the flag.

    Example:
        >>> import argparse
        >>> p = argparse.ArgumentParser()
        >>> _ = p.add_argument("--remat", type=remat_flag, default="auto")
        >>> p.parse_args(["--remat", "full:2"]).remat
        'full:2'
    """
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return parse_remat(text, source="--remat")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def knob(
    name: str, value: Any = "auto", default: Any = None, environ: Mapping[str, str] | None = None
) -> Any:
    """The script's `value` for knob `name`, unless it is `"auto"`: then the launch configuration's (set by
    `accelfn launch/dry-run --config plan.yaml`, which `accelfn plan --write` writes), else `default`.

    A script leaves a choice to the planner by passing "auto" (e.g. from a `--strategy auto` flag); a value it
    fixes is kept, and `accelfn plan` says so. Knobs: strategy, remat, accumulate, global_batch_size,
    pipeline_schedule, pipeline_microbatches, pipeline_sync_each_microbatch (a bool), offload, compile.

    Example:
        >>> knob("strategy", "auto", "fsdp", environ={"ACCELFN_STRATEGY": "hsdp"})
        'hsdp'
        >>> knob("strategy", "ddp", "fsdp", environ={"ACCELFN_STRATEGY": "hsdp"}), knob("accumulate", environ={})
        ('ddp', None)
    """
    if name not in KNOBS:
        raise ValueError(f"accelfn.launch_env.knob: unknown knob {name!r}; knobs: {', '.join(KNOBS)}")
    if value != "auto":
        FIXED[name] = value
        return value
    ASKED.add(name)
    env = os.environ if environ is None else environ
    raw = env.get(KNOBS[name][0], "").strip()
    return parse_knob(name, raw) if raw else default


@contextlib.contextmanager
def environ_set(env: Mapping[str, str], unset: Iterable[str] = ()) -> Iterator[None]:
    """`os.environ` with `env` set and `unset` removed for the block, then as it was.

    Example:
        >>> with environ_set({"ACCELFN_STRATEGY": "ddp"}):
        ...     os.environ["ACCELFN_STRATEGY"]
        'ddp'
    """
    unset = tuple(unset)
    saved = {k: os.environ.get(k) for k in (*env, *unset)}
    for k in unset:
        os.environ.pop(k, None)
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
