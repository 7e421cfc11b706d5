"""The memory plan's total against the whole peak of a rank (gloo at world size 1, no Ray): every tensor storage
made from the rank's construction through three steps is counted while it lives (`bench.step.LiveBytes`, the CPU's
stand-in for the `torch.cuda.max_memory_allocated` that `python -m bench.gpu` sets beside the plan on a GPU), and
its peak must be the plan's `total` to within 3%. The peak is the fused loss's, at the end of the forward, when
every activation is kept: without the loss's transient (`fused_loss_transient`) the plan was 17% under. The bf16
cases (the loss's bf16 copies under autocast) are in `make test-slow`: bf16 on a CPU takes some 40 s each."""

from __future__ import annotations

import pytest
import torch
from helpers import SLOW
from trainyard.parallel.config import DataConfig, JobConfig, ModelConfig, ParallelConfig
from trainyard.parallel.plan import make_plan
from trainyard.parallel.plan.memory.estimate import rank_memory
from trainyard.parallel.runtime.driver import RankDriver
from trainyard.parallel.runtime.local_world import free_ports

from bench.step import LiveBytes

GPT = ModelConfig(n_layer=4, n_head=4, d_model=256, vocab_size=8192, seq_len=128)
LLAMA = ModelConfig(family="llama", n_layer=4, n_head=4, n_kv_head=2, d_model=256, vocab_size=8192, seq_len=128)


@pytest.mark.parametrize(("model", "precision", "recompute", "microbatches"), [
    pytest.param(GPT, "bf16", "none", 1, marks=SLOW, id="gpt2-bf16"),  # bf16 on a CPU: 40 s each, in test-slow
    pytest.param(LLAMA, "fp32", "selective", 2, id="llama-fp32-selective-m2"),
    pytest.param(GPT, "bf16", "full", 1, marks=SLOW, id="gpt2-bf16-full")])
def test_the_plan_s_total_is_the_rank_s_peak(model, precision, recompute, microbatches):
    config = JobConfig(name="peak", model=model, steps=3, data=DataConfig(kind="synthetic"), global_batch=8,
                       precision=precision, activation_checkpointing=recompute,
                       parallel=ParallelConfig(microbatches=microbatches))
    plan = make_plan(config)
    torch.set_num_threads(1)
    with LiveBytes() as meter:
        driver = RankDriver(plan, 0, "127.0.0.1", free_ports(1)[0], torch.device("cpu"), 60.0)
        try:
            driver.run(range(3))
        finally:
            driver.close()
    predicted = rank_memory(plan, 0)
    assert predicted.loss > 0
    assert predicted.total == pytest.approx(meter.peak, rel=0.03), (predicted.to_dict(), meter.peak)
