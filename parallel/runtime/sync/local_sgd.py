"""`parallel.sync.kind: local_sgd` (Stich 2019, Lin et al. 2020): each replica steps on its own share of the step's
global batch with no traffic between replicas; every `every` steps (and after the last) the replicas' parameters
are averaged, and every replica goes on from the mean. No state of its own (a checkpoint, a rejoining replica: the
parameters and the inner moments are all there is).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainyard.parallel.runtime.sync.averaging import ParameterAveraging

if TYPE_CHECKING:
    import torch


class LocalSGD(ParameterAveraging):
    """Every replica takes the mean of the replicas' parameters."""

    def _take(self, mean: list[torch.Tensor]) -> None:
        for p, m in zip(self.params, mean, strict=True):
            p.copy_(m.view_as(p))
