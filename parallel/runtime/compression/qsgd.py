"""QSGD gradient quantization (Alistarh et al. 2017, "QSGD: Communication-Efficient SGD via Gradient Quantization
and Encoding") on the data-parallel reduction: unbiased stochastic rounding, no error feedback.

`parallel.grad_compression: {kind: qsgd, levels: s, bucket_size: d}` picks `QSGD` from the registry
(`parallel.runtime.compression.COMPRESSORS`). Each gradient matrix (`parallel.runtime.compression.gathered`) is cut
into buckets of d consecutive elements (the last one shorter), and each bucket v is sent as its norm and, per
element, a sign and a level (the paper's Q_s, `quantize`):

    Q_s(v_i) = ||v||_2 . sign(v_i) . l_i / s,   l_i = floor(r_i) + 1 with probability r_i - floor(r_i), else
    floor(r_i), where r_i = s |v_i| / ||v||_2 (in 0..s)

so E[Q_s(v_i)] = v_i (unbiased) and E ||Q_s(v) - v||^2 <= min(d / s^2, sqrt(d) / s) ||v||^2 (the paper's
Lemma 3.1; per element the variance is ||v||^2 / s^2 . p (1 - p) <= ||v||^2 / (4 s^2), p = r_i - floor(r_i)).
On the wire a code is sign(v_i) l_i + s, in 0..2s, packed at 2, 4 or 8 bits (`pack`,
`parallel.plan.grad_compression.qsgd_code_bits`), and each norm is fp32: the paper's Elias coding of the levels
is left out (a fixed width packs with plain tensor ops and gives every rank's payload one size, which an
all-gather needs). The codes are all-gathered and every rank decodes and sums every rank's, rank 0 first.

The rounding draws uniform numbers from a generator seeded by (job seed, step, global rank, reduction group,
bucket, matrix) (`parallel.seeds.derive_seed`): ranks round independently, and a run reproduces exactly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from trainyard.parallel.plan.grad_compression import qsgd_bytes, qsgd_code_bits
from trainyard.parallel.runtime.compression.gathered import GatheringCompressor, GatheringReducer
from trainyard.parallel.runtime.dp.data_parallel import ShardedGradientReducer
from trainyard.parallel.seeds import derive_seed


def quantize(v: torch.Tensor, levels: int, bucket_size: int,
             generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, norms) of a 1-D fp32 `v`: per element its code sign(v_i) l_i + levels (uint8, in 0..2 levels), per
    bucket of `bucket_size` elements its L2 norm (fp32)."""
    n = v.numel()
    buckets = -(-n // bucket_size)
    padded = torch.zeros(buckets * bucket_size, dtype=torch.float32, device=v.device)
    padded[:n] = v
    rows = padded.view(buckets, bucket_size)
    norms = torch.linalg.vector_norm(rows, dim=1)
    scaled = rows.abs() / norms.clamp(min=torch.finfo(torch.float32).tiny)[:, None] * levels
    low = scaled.floor()
    u = torch.rand(scaled.shape, generator=generator, device=v.device)
    level = (low + (u < scaled - low)).clamp(max=levels)  # fp32 may put |v_i| / ||v|| a hair above 1
    codes = (torch.sign(rows) * level + levels).view(-1)[:n]
    return codes.to(torch.uint8), norms


def dequantize(codes: torch.Tensor, norms: torch.Tensor, levels: int, bucket_size: int) -> torch.Tensor:
    """The fp32 values of `quantize`'s codes: ||v|| . (code - levels) / levels."""
    n = codes.numel()
    scale = (norms / levels).repeat_interleave(bucket_size)[:n]
    return (codes.to(torch.float32) - levels) * scale


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of `bits` (2, 4 or 8) bits each, packed 8 / bits to a byte (the first in the low bits; the last
    byte padded with zeros)."""
    per = 8 // bits
    if per == 1:
        return codes
    padded = torch.zeros(-(-codes.numel() // per) * per, dtype=torch.int32, device=codes.device)
    padded[:codes.numel()] = codes
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    return (padded.view(-1, per) << shifts).sum(dim=1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """`pack`'s n codes back, uint8."""
    per = 8 // bits
    if per == 1:
        return packed[:n]
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    return ((packed.to(torch.int32)[:, None] >> shifts) & ((1 << bits) - 1)).view(-1)[:n].to(torch.uint8)


class QSGDReducer(GatheringReducer):
    """The plain reducer with each bucket's gradient matrices sent as QSGD codes and norms (uint8 on the wire)."""

    wire_dtype = torch.uint8

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        ranks = dist.get_process_group_ranks(self.group) if self.group is not None else [self.global_rank]
        self._group_key = "-".join(map(str, ranks))

    def wire_length(self, elements: int) -> int:
        return qsgd_bytes(elements, self.compressor.config)

    def generator(self, key: tuple[int, int], device: torch.device) -> torch.Generator:
        """Matrix `key`'s rounding stream this step, on this rank."""
        c = self.compressor
        seed = derive_seed(c.seed, "qsgd", c.step, self.global_rank, self._group_key, *key)
        return torch.Generator(device=device).manual_seed(seed)

    def encode(self, key: tuple[int, int], grad: torch.Tensor) -> torch.Tensor:
        cfg = self.compressor.config
        codes, norms = quantize(grad.float(), cfg.levels, cfg.bucket_size, self.generator(key, grad.device))
        return torch.cat([pack(codes, qsgd_code_bits(cfg.levels)), norms.view(torch.uint8)])

    def add_decoded(self, total: torch.Tensor, codes: torch.Tensor) -> None:
        cfg, n = self.compressor.config, total.numel()
        bits, buckets = qsgd_code_bits(cfg.levels), -(-n // cfg.bucket_size)
        packed = -(-n * bits // 8)
        norms = codes[packed:packed + 4 * buckets].clone().view(torch.float32)  # copied: 4-byte aligned
        total.add_(dequantize(unpack(codes[:packed], bits, n), norms, cfg.levels, cfg.bucket_size))


class ShardedQSGDReducer(QSGDReducer, ShardedGradientReducer):
    """ZeRO-1 with QSGD: the decoded sum fills the whole bucket, this rank keeps its slice."""


class QSGD(GatheringCompressor):
    """The QSGD compressor the trainer's reducers share (a `Compressor`)."""

    reducers = (QSGDReducer, ShardedQSGDReducer)
