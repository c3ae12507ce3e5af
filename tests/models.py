"""Tiny models for tests, built from configs (no download)."""

import torch
from torch import nn


def tiny_gpt2(dropout: float = 0.0, n_layer: int = 2, n_embd: int = 32, vocab: int = 64):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=32,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=2,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        tie_word_embeddings=True,
    )
    return GPT2LMHeadModel(cfg)


def tiny_llama(vocab: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def tiny_bert(vocab: int = 64):
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(cfg)


class MLP(nn.Module):
    def __init__(self, d_in=8, d_hidden=16, d_out=4, batchnorm=False, dropout=0.0):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.norm = nn.BatchNorm1d(d_hidden) if batchnorm else nn.Identity()
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.norm(self.fc1(x)))))


def lm_batches(n: int, batch: int = 4, seq: int = 16, vocab: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        labels = ids.clone()
        labels[:, : seq // 4] = -100  # some ignored positions
        out.append({"input_ids": ids, "labels": labels})
    return out
