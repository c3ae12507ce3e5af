"""``accelfn estimate-memory``: a model's size, largest layer and AdamW training memory per dtype, from its
config alone (the model is built on the meta device: nothing is allocated or downloaded).

Example:
    $ accelfn estimate-memory path/to/config.json --dtypes float32 bfloat16 int8
    $ accelfn estimate-memory mypkg.models:build_model
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "float8": 1.0, "int8": 1.0, "int4": 0.5}
"""Bytes per weight of each dtype `--dtypes` accepts."""


def build(spec: str) -> Any:
    """The model `spec` names, on the meta device: a transformers config (a `config.json` or a folder with one)
    or a factory `pkg.module:function` called with no arguments."""
    import accelfn as af

    path = Path(spec)
    if path.exists():
        config = _config_of(path / "config.json" if path.is_dir() else path)
        with af.init_empty():
            return _model_of(config)
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise ValueError(f"{spec!r} is neither a file or folder nor a factory 'pkg.module:function'")
    if "" not in sys.path and os.getcwd() not in sys.path:  # as `python -m` would: the current folder first
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot find the factory {spec!r}: {e}") from None
    if not callable(factory):
        raise ValueError(f"{spec!r} is a {type(factory).__name__}, not a function that builds the model")
    with af.init_empty():
        model = factory()
    if not hasattr(model, "parameters"):
        raise ValueError(f"the factory {spec!r} returned a {type(model).__name__}, not an nn.Module")
    return model


def _config_of(path: Path) -> Any:
    """The transformers config in the JSON file `path`; an unknown `model_type` is named with the closest known."""
    import difflib

    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not path.is_file():
        raise ValueError(f"{path.parent} has no config.json: is it a transformers model folder?")
    try:
        fields = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a JSON config ({e})") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ValueError(f"{path} has no 'model_type': is it a transformers config.json?")
    model_type = fields.pop("model_type")
    if model_type not in CONFIG_MAPPING:
        import transformers

        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"{path}: model_type {model_type!r} is not one transformers {transformers.__version__} knows{hint}"
        )
    return AutoConfig.for_model(model_type, **fields)


def _model_of(config: Any) -> Any:
    """The model class the config's `architectures` names (as `from_pretrained` would build), else the causal
    LM of its type, else the bare model."""
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and hasattr(cls, "_from_config"):
            return cls._from_config(config)
    try:
        return AutoModelForCausalLM.from_config(config)
    except ValueError:  # not a causal LM: the bare model
        return AutoModel.from_config(config)


def estimate(model: Any, dtypes: list[str]) -> list[dict[str, Any]]:
    """Rows of `{dtype, params, total, largest_layer, training}` in bytes. Training with AdamW counts weights
    and gradients in the dtype, two fp32 moments, and an fp32 master copy when the dtype is narrower than fp32."""
    from accelfn.big.device_map import layout_of

    floating = other = 0
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        if t.is_floating_point():
            floating += t.numel()
        else:
            other += t.numel() * t.element_size()
    import torch

    largest_fp32 = layout_of(
        model, getattr(model, "_no_split_modules", None) or (), torch.float32
    ).largest_layer[""]
    rows = []
    for name in dtypes:
        b = BYTES[name]
        master = 4.0 if b < 4 else 0.0
        rows.append({
            "dtype": name,
            "params": floating,
            "total": int(floating * b + other),
            "largest_layer": int(largest_fp32 * b / 4),
            "training": int(floating * (2 * b + 8 + master) + other),
        })  # fmt: skip
    return rows


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "estimate-memory",
        help="memory a model needs for inference and training, from its config",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model", metavar="CONFIG_OR_PATH", help="config.json, a folder with one, or pkg.module:factory"
    )
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"], choices=list(BYTES))
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from accelfn.big.memory import format_size

    try:
        model = build(args.model)
    except ValueError as e:
        print(f"accelfn estimate-memory: {e}", file=sys.stderr)
        return 2
    rows = estimate(model, args.dtypes)
    print(f"{args.model}: {type(model).__name__}, {rows[0]['params'] / 1e6:,.2f}M parameters")
    print("| dtype | total size | largest layer | training with AdamW |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['dtype']} | {format_size(r['total'])} | {format_size(r['largest_layer'])} | {format_size(r['training'])} |"
        )
    return 0
