"""`parallel.sync.kind: diloco` (Douillard et al. 2023): as local_sgd, but at a sync the averaged change since the
last sync, the pseudo-gradient `anchor - mean(params)`, is the gradient of an outer SGD with Nesterov momentum
(`outer_lr`, `outer_momentum`) over the anchor (the parameters of the last sync); every replica then starts again
from the new anchor.

The math is torchft's DiLoCo: the outer optimizer is torch's own SGD (nesterov) over the anchor, its `.grad` the
pseudo-gradient. The anchor and the momentum are local shards, as the mean is. Its own state is the outer momentum:
checkpointed (`outer_state`, laid out like the parameters) and broadcast to a rejoining replica
(`momentum_buffers`); the anchor is the parameters after a checkpoint's load or a replica's state (`took_state`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainyard.parallel.runtime.sync.averaging import ParameterAveraging

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from trainyard.parallel.config import SyncConfig


class DiLoCo(ParameterAveraging):
    """The replicas' mean moves the anchor through the outer Nesterov SGD; every replica takes the new anchor."""

    def __init__(self, cfg: SyncConfig, params: list[torch.Tensor], group: dist.ProcessGroup | None, dp: int,
                 apart: frozenset[int] = frozenset()):
        from trainyard.parallel.optim.dynamo_free import SGD

        super().__init__(cfg, params, group, dp, apart)
        self.anchor = [p.detach().clone() for p in self.params]  # local shards, as the mean is
        momentum = cfg.outer_momentum
        self.outer: torch.optim.Optimizer = SGD(self.anchor, lr=cfg.outer_lr, momentum=momentum,
                                                nesterov=momentum > 0)

    def _take(self, mean: list[torch.Tensor]) -> None:
        for a, m in zip(self.anchor, mean, strict=True):
            a.grad = a - m.view_as(a)  # the pseudo-gradient
        self.outer.step()
        for p, a in zip(self.params, self.anchor, strict=True):
            p.copy_(a)

    def took_state(self) -> None:
        """The parameters were replaced (a checkpoint, always taken at a sync, or a replica's state): they are
        the anchor."""
        import torch

        with torch.no_grad():
            for a, p in zip(self.anchor, self.params, strict=True):
                a.copy_(p)

    def momentum_buffers(self) -> list[torch.Tensor]:
        """The outer momentum buffers as local tensors (created at zero if the outer step has not run)."""
        if not self.outer_state():
            return []
        return [self.outer.state[a]["momentum_buffer"] for a in self.anchor]

    def outer_state(self) -> list[torch.Tensor]:
        """The outer optimizer's momentum buffers, one per parameter and laid out like it (a DTensor with tp, so
        a checkpoint stores each shard once), for a checkpoint (with momentum; created at zero, as SGD's first step
        would)."""
        import torch
        from torch.distributed.tensor import DTensor

        if self.cfg.outer_momentum == 0:
            return []
        for a in self.anchor:
            state = self.outer.state[a]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(a)
        return [DTensor.from_local(self.outer.state[a]["momentum_buffer"], p.device_mesh, p.placements, shape=p.shape,
                                   stride=p.stride(), run_check=False) if isinstance(p, DTensor)
                else self.outer.state[a]["momentum_buffer"] for a, p in zip(self.anchor, self.layouts, strict=True)]
