"""examples/train_moe.py's `--model deepseek-v3` at tiny sizes (its first 3 layers dense, the rest MoE with 4
routed experts and one shared, MLA attention): the example itself, its DeepseekV3Config given small widths.

    python tests/workers/tiny_deepseek_moe.py --model deepseek-v3 --layers 10 --steps 2
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from transformers import DeepseekV3Config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import train_moe  # noqa: E402

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, num_attention_heads=4,
            num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16)  # fmt: skip
train_moe.DeepseekV3Config = functools.partial(DeepseekV3Config, **TINY)  # type: ignore[misc]

if __name__ == "__main__":
    train_moe.main()
