"""What qwen3 adds to llama's memory counting (`parallel.models.llama.counts`): its two per-head RMSNorms.

Pure arithmetic: no torch.
"""

from __future__ import annotations

from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models.counting import FP32, Shapes


def qk_norms(m: ModelConfig, s: Shapes) -> int:
    """What ln_q and ln_k keep per micro-batch on this rank's heads: as `llama.counts.rms_norm`, per head
    row (the input, the normalised input, one reciprocal root-mean-square), fp32 also under autocast (the
    norm runs in fp32 and q and k enter it as the projections' outputs)."""
    rows = s.tokens * (m.n_head + (m.n_kv_head or m.n_head)) // s.tp
    return rows * (2 * FP32 * m.head_size + FP32)
