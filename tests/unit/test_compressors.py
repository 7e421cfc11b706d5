"""Top-k's and QSGD's pure parts in-process, no ranks: top-k's selection (what is sent plus what is kept is the
gradient, exactly), QSGD's quantizer against the paper's claims (unbiased: the mean over many seeds is the gradient
within its variance bound; the error within Lemma 3.1's bound; reproducible per seed), its packing, and the codes
each reducer puts on the wire against the bytes the plan counts. The reducers on real ranks:
tests/integration/test_grads_gloo.py (the math) and tests/integration/test_compressors_gloo.py (whole runs)."""

from __future__ import annotations

import math

import pytest
import torch
from trainyard.parallel.config import GradCompressionConfig
from trainyard.parallel.plan.grad_compression import COMPRESSIONS, qsgd_bytes, qsgd_code_bits, topk_count
from trainyard.parallel.runtime.compression import make_compressor
from trainyard.parallel.runtime.compression.qsgd import dequantize, pack, quantize, unpack
from trainyard.parallel.runtime.compression.topk import select


def _vector(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * torch.linspace(0.1, 3.0, n)


def test_topk_sends_the_largest_magnitudes_and_keeps_the_rest_exactly():
    acc = _vector(300)
    k = topk_count(300, 0.1)
    indices, values, residual = select(acc, k)
    assert k == 30 and indices.numel() == 30 and torch.equal(values, acc[indices])
    assert acc[indices].abs().min() >= residual.abs().max()  # nothing kept is larger than anything sent
    sent = torch.zeros(300).index_add_(0, indices, values)
    assert torch.equal(sent + residual, acc)  # bitwise: disjoint supports
    assert torch.count_nonzero(residual) == 300 - 30
    everything = select(acc, 300)
    assert torch.equal(torch.zeros(300).index_add_(0, everything[0], everything[1]), acc)
    assert not everything[2].any()  # ratio 1: nothing kept


@pytest.mark.parametrize("levels,bucket", [(1, 64), (7, 64), (7, 1000), (127, 16)])
def test_qsgd_is_unbiased_within_its_variance_bound(levels, bucket):
    """Alistarh et al.'s Lemma 3.1: E[Q_s(v)] = v, and per element Var = ||v||^2 / s^2 . p (1 - p) <= ||v||^2 /
    (4 s^2) (||v|| its bucket's norm); the squared error's mean is within min(d / s^2, sqrt(d) / s) ||v||^2."""
    v, draws = _vector(1000), 400
    codes = [quantize(v, levels, bucket, torch.Generator().manual_seed(seed)) for seed in range(draws)]
    decoded = torch.stack([dequantize(c, norms, levels, bucket) for c, norms in codes])
    padded = torch.zeros(-(-1000 // bucket) * bucket)
    padded[:1000] = v
    norms = padded.view(-1, bucket).norm(dim=1).repeat_interleave(bucket)[:1000]
    sigma = norms / (2 * levels)  # the largest standard deviation of one element's rounding
    assert ((decoded.mean(dim=0) - v).abs() <= 5 * sigma / math.sqrt(draws) + 1e-6).all()
    bound = min(bucket / levels**2, math.sqrt(bucket) / levels) * v.pow(2).sum()
    squared = (decoded - v).pow(2).sum(dim=1)
    assert squared.mean() <= bound and squared.mean() > 0
    # each decoded value is a level of its bucket's norm: the sign of v, |x| = l ||v|| / s
    levels_hit = (decoded[0].abs() / norms * levels)
    torch.testing.assert_close(levels_hit, levels_hit.round(), rtol=0, atol=1e-4)
    assert ((decoded[0] == 0) | (decoded[0].sign() == v.sign())).all()


def test_qsgd_reproduces_per_seed_and_rounds_independently_across_seeds():
    v = _vector(500)
    a, b = (quantize(v, 7, 128, torch.Generator().manual_seed(11)) for _ in range(2))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], quantize(v, 7, 128, torch.Generator().manual_seed(12))[0])
    zeros, norms = quantize(torch.zeros(100), 7, 64, torch.Generator().manual_seed(0))
    assert not dequantize(zeros, norms, 7, 64).any()  # a zero gradient stays zero, no division by its norm


@pytest.mark.parametrize("levels,bits", [(1, 2), (2, 4), (7, 4), (8, 8), (127, 8)])
def test_qsgd_codes_pack_into_their_bits_and_back(levels, bits):
    assert qsgd_code_bits(levels) == bits
    codes = torch.randint(0, 2 * levels + 1, (1001,), generator=torch.Generator().manual_seed(3)).to(torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(1001 * bits / 8)
    assert torch.equal(unpack(packed, bits, 1001), codes)


@pytest.mark.parametrize("cfg", [GradCompressionConfig(kind="topk", ratio=0.1),
                                 GradCompressionConfig(kind="topk", ratio=1.0, error_feedback=False),
                                 GradCompressionConfig(kind="qsgd", levels=7, bucket_size=50),
                                 GradCompressionConfig(kind="qsgd", levels=1),
                                 GradCompressionConfig(kind="qsgd", levels=100)])
def test_what_a_reducer_puts_on_the_wire_is_what_the_plan_counts_and_decodes_back(cfg):
    """A reducer over no group (its hooks need none) encodes a 24 x 31 gradient: its codes' bytes are the plan's
    `sent` for that matrix, and decoding them gives what the compressor meant to send."""
    from trainyard.parallel.runtime.dp.data_parallel import GradientReducer

    compressor = make_compressor(cfg, seed=5)
    p = torch.nn.Parameter(torch.zeros(24, 31))
    reducer = compressor.reducer_class(GradientReducer)([[p]], None, compressor)
    grad = _vector(24 * 31, seed=1)
    codes = reducer.encode((0, 0), grad)
    assert codes.dtype == reducer.wire_dtype
    assert codes.numel() * codes.element_size() == COMPRESSIONS[cfg.kind].matrix(24, 31, cfg, 2).sent
    assert codes.numel() == reducer.wire_length(24 * 31)
    total = torch.zeros(24 * 31)
    reducer.add_decoded(total, codes)
    if cfg.kind == "topk":
        kept = reducer.residuals.get((0, 0), torch.zeros(24 * 31))
        assert torch.equal(total + kept, grad)  # sent + kept = the gradient, exactly
        assert torch.count_nonzero(total) == topk_count(24 * 31, cfg.ratio)
    else:
        assert qsgd_bytes(24 * 31, cfg) == codes.numel()
        step0 = total.clone()
        compressor.step = 1  # another step rounds anew, the same step again reproduces
        again = torch.zeros(24 * 31)
        reducer.add_decoded(again, reducer.encode((0, 0), grad))
        assert not torch.equal(again, step0)
        compressor.step = 0
        same = torch.zeros(24 * 31)
        reducer.add_decoded(same, reducer.encode((0, 0), grad))
        assert torch.equal(same, step0)
