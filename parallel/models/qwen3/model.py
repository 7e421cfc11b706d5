"""Qwen3's decoder: llama's stage with Qwen3's attention (`blocks.{i}.attn.ln_q.weight` and `ln_k.weight`, the
per-head norms, next to llama's names); also qwen3_moe's, whose MoE blocks hold llama's SwiGLU experts."""

from __future__ import annotations

from torch import nn
from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models.llama.model import LlamaStage
from trainyard.parallel.models.qwen3.layers import Qwen3Attention


class Qwen3Stage(LlamaStage):
    @staticmethod
    def attention(cfg: ModelConfig) -> nn.Module:
        return Qwen3Attention(cfg)
