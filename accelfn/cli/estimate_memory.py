"""``accelfn estimate-memory``: a model's size, largest layer and AdamW training memory per dtype, from its
config alone (the model is built on the meta device: nothing is allocated; of a Hub id, only its config.json is
downloaded, or read from the Hugging Face cache).

Example:
    $ accelfn estimate-memory path/to/config.json --dtypes float32 bfloat16 int8
    $ accelfn estimate-memory meta-llama/Llama-3.1-8B
    $ accelfn estimate-memory gpt2
    $ accelfn estimate-memory mypkg.models:build_model
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "float8": 1.0, "int8": 1.0, "int4": 0.5}
"""Bytes per weight of each dtype `--dtypes` accepts."""


HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]*/[\w.-]+|[A-Za-z0-9][\w.-]*)$")
"""A Hugging Face Hub model id, `org/name` or one without an org (`gpt2`, `bert-base-uncased`), where no path
of that name exists here (as Accelerate reads any name it is given)."""


def build(spec: str, notes: list[str] | None = None) -> Any:
    """The model `spec` names, on the meta device: a transformers config (a `config.json`, a folder with one, or
    a Hub id `org/name` or `name`, whose config.json alone is fetched: `hub_config`) or a factory `pkg.module:function`
    called with no arguments. What was guessed (e.g. a class named in `architectures` that transformers lacks)
    is appended to `notes`, one line each."""
    import accelfn as af

    notes = [] if notes is None else notes
    path = Path(spec)
    if not path.exists() and path.suffix == ".json":
        raise ValueError(f"{spec}: no such file")
    if not path.exists() and ":" not in spec and HUB_ID.match(spec):
        if "/" in spec:
            path = hub_config(spec)
        else:  # a bare name may as well be a mistyped path or a factory missing its colon: say so too
            try:
                path = hub_config(spec)
            except ValueError as e:
                head = spec.split(".")[0]
                factory = (
                    f"; a factory is written 'pkg.module:function' ({head!r} is an importable module)"
                    if "." in spec and importlib.util.find_spec(head) is not None
                    else ""
                )
                raise ValueError(
                    f"no file or folder named {spec!r} here{factory}; as a Hub id: {e}"
                ) from None
    if path.exists():
        with _quiet():
            config = _config_of(path / "config.json" if path.is_dir() else path, notes)
            try:
                with af.init_empty():
                    return _model_of(config, notes)
            except (ValueError, TypeError) as e:  # the config's values do not build its model
                raise ValueError(f"{path}: {_one_line(e)}") from None
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise ValueError(
            f"{spec!r} is not a file or folder here, a Hub id ('org/name' or 'name'), or a factory "
            "'pkg.module:function'"
        )
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


def hub_config(repo_id: str) -> Path:
    """The local path of Hub model `repo_id`'s config.json: from the Hugging Face cache, else downloaded (that
    file alone, as `accelerate estimate-memory` does; never the weights). Offline (`HF_HUB_OFFLINE=1`) or
    without a connection, only the cache; a `ValueError` naming the id and what to do when it is not there."""
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:  # transformers brings it; without transformers nothing can be estimated anyway
        raise ValueError(
            f"{repo_id!r} looks like a Hub id, but huggingface_hub is not installed: pip install transformers, "
            "or pass a local config.json"
        ) from None
    try:
        with _quiet():
            return Path(hf_hub_download(repo_id, "config.json"))
    except LocalEntryNotFoundError:  # offline, or no connection, and not in the cache
        raise ValueError(
            f"{repo_id!r} looks like a Hub id, but its config.json is not in the Hugging Face cache and could not "
            f"be downloaded (offline: HF_HUB_OFFLINE={os.environ.get('HF_HUB_OFFLINE', 'unset')}); on a machine "
            f"online: `hf download {repo_id} config.json`, then pass that file"
        ) from None
    except HfHubHTTPError as e:  # no such repository, a gated one without a token, ...
        raise ValueError(f"{repo_id!r}: the Hub did not give its config.json ({_one_line(e)})") from None
    except OSError as e:  # e.g. the repository has no config.json
        raise ValueError(f"{repo_id!r}: cannot read its config.json from the Hub ({_one_line(e)})") from None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Library chatter while a config's model is built (transformers' advice, optional backends' import
    warnings) is not the estimate: logging up to WARNING and Python warnings are silenced meanwhile."""
    import logging
    import warnings

    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(before)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _architectures(fields: dict[str, Any]) -> list[str]:
    """The class names in the config's `architectures` (a list, or one name)."""
    names = fields.get("architectures") or []
    return [names] if isinstance(names, str) else [str(n) for n in names if n]


def _transformers_class(name: str) -> Any:
    """The transformers model class `name`, or None (not one of transformers', e.g. remote code)."""
    import transformers

    try:
        cls = getattr(transformers, name, None)
    except Exception:  # a lazily imported module that fails to import (a missing optional backend)
        return None
    return (
        cls
        if isinstance(cls, type) and hasattr(cls, "_from_config") and hasattr(cls, "config_class")
        else None
    )


def _config_of(path: Path, notes: list[str]) -> Any:
    """The transformers config in the JSON file `path`. Without `model_type`, the type of the class
    `architectures` names (as `from_pretrained` of that class would read it); an unknown type is one line
    naming it with the closest known."""
    import difflib

    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not path.is_file():
        raise ValueError(f"{path.parent} has no config.json: is it a transformers model folder?")
    try:
        fields = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a JSON config ({e})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{path} is not a transformers config.json (a JSON object)")
    architectures = _architectures(fields)
    model_type = fields.pop("model_type", None)
    if model_type is None:
        known = [c for c in map(_transformers_class, architectures) if c is not None]
        model_type = getattr(known[0].config_class, "model_type", None) if known else None
        if not model_type:
            named = (
                f" nor an 'architectures' transformers {transformers.__version__} has"
                if architectures
                else ""
            )
            raise ValueError(f"{path} has no 'model_type'{named}: is it a transformers config.json?")
        notes.append(
            f"{path} has no 'model_type': {model_type!r}, the type of {known[0].__name__} (architectures)"
        )
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        custom = " (custom code? pass a factory pkg.module:function)" if "auto_map" in fields else ""
        raise ValueError(
            f"{path}: model_type {model_type!r} is not one transformers {transformers.__version__} knows"
            f"{custom}{hint}"
        )
    fields["architectures"] = architectures or None
    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # any way a config's values are refused: one line, no traceback
        raise ValueError(f"{path}: not a valid {model_type!r} config ({_one_line(e)})") from None


def _model_of(config: Any, notes: list[str]) -> Any:
    """The model class the config's `architectures` names (as `from_pretrained` would build), else the causal
    LM of its type, else the bare model."""
    from transformers import AutoModel, AutoModelForCausalLM

    names = getattr(config, "architectures", None) or []
    for name in names:
        cls = _transformers_class(name)
        if cls is not None and isinstance(config, cls.config_class):
            return cls._from_config(config)
    try:
        model = AutoModelForCausalLM.from_config(config)
    except ValueError:  # not a causal LM: the bare model
        model = AutoModel.from_config(config)
    if names:
        notes.append(
            f"architectures {', '.join(names)}: not a transformers {config.model_type!r} model class "
            f"(remote code is not run); estimated {type(model).__name__} instead"
        )
    return model


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
        "model",
        metavar="CONFIG_OR_PATH",
        help="config.json, a folder with one, a Hub id org/name or name (its config.json only), or pkg.module:factory",
    )
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8"], choices=list(BYTES))
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from accelfn.big.memory import format_size

    notes: list[str] = []
    try:
        model = build(args.model, notes)
    except ValueError as e:
        print(f"accelfn estimate-memory: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"accelfn estimate-memory: note: {note}", file=sys.stderr)
    rows = estimate(model, args.dtypes)
    print(f"{args.model}: {type(model).__name__}, {rows[0]['params'] / 1e6:,.2f}M parameters")
    print("| dtype | total size | largest layer | training with AdamW |")
    print("|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['dtype']} | {format_size(r['total'])} | {format_size(r['largest_layer'])} | {format_size(r['training'])} |"
        )
    return 0
