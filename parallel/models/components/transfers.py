"""Host data on its way to the device without the host waiting for the device.

On CUDA a copy from pageable host memory (`t.to(device)`, `torch.tensor(data, device=...)`) is `cudaMemcpyAsync`
followed by a synchronization of the stream: the host waits for every kernel queued before it, which is the
previous step's whole work when the next step's first micro-batch goes over, so the device idles while the host
queues the step (the wait `RankDriver` reads a step's figures one step late to avoid). `to_device` pins the host
tensor and copies it `non_blocking`: the copy is queued on the stream like a kernel, in order with the work that
reads it, and torch's pinned-memory allocator keeps the pinned block until the copy is done. Elsewhere (the CPU) it
is `t.to(device)`.

What a step sends: its micro-batches' inputs and targets (`parallel.runtime.pipeline.pipeline`), packed data's documents
(`parallel.models.components.documents`) and a dropless MoE layer's expert offsets for the grouped matmul
(`parallel.models.components.moe`). tests/unit/test_host_reads.py checks that a step makes no other copy to the device.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (on the host) on `device`, copied without waiting for the device (module doc)."""
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)
