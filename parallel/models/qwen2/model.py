"""Qwen2's decoder: llama's stage whose attention has biases on q, k and v (`blocks.{i}.attn.{q,k,v}.bias`;
attn.proj has none, as in transformers' Qwen2Attention)."""

from __future__ import annotations

from torch import nn
from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models.llama.layers import LlamaAttention
from trainyard.parallel.models.llama.model import LlamaStage


class Qwen2Attention(LlamaAttention):
    QKV_BIAS = True


class Qwen2Stage(LlamaStage):
    @staticmethod
    def attention(cfg: ModelConfig) -> nn.Module:
        return Qwen2Attention(cfg)
