"""The ClientSession actor: one training client of the Tinker-compatible API (`service.tinker`), a live job of its
own kind. Instead of the coordinator's fixed loop, it holds the client's rank between calls and runs each call the
user's program makes on it (`parallel.runtime.open_loop.OpenLoopRank`: forward_backward, optim_step).

Calls to one actor run one at a time in the order they were made (Ray's ordered actor calls), which is the order the
SDK's requests arrive in. A call that the caller got wrong raises `OpenLoopError` (its message names the field); any
other failure leaves the rank unusable and every later call says so, instead of running on half-applied state.
"""

from __future__ import annotations

import socket
import sys
import traceback
from typing import TYPE_CHECKING, Any

import ray
from trainyard.parallel.plan import Plan

if TYPE_CHECKING:
    from trainyard.parallel.runtime.open_loop import OpenLoopRank


@ray.remote
class ClientSession:
    def __init__(self, model_id: str, plan: Plan, threads: int):
        import torch

        torch.set_num_threads(max(1, threads))
        self.model_id, self.plan = model_id, plan
        self.rank: OpenLoopRank | None = None
        self.broken: str | None = None
        """Why the rank is unusable (a call failed inside it), or None."""

    def setup(self) -> dict[str, Any]:
        """Build the rank (its process group of one, the model from `init_from`, LoRA, the optimizer)."""
        from trainyard.parallel.runtime.driver import RankDriver
        from trainyard.parallel.runtime.open_loop import OpenLoopRank

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            self.rank = OpenLoopRank(RankDriver(self.plan, 0, "127.0.0.1", port))
        except Exception as e:
            self.broken = f"{type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
            raise
        return {"model_id": self.model_id, "device": str(self.rank.driver.device)}

    def forward_backward(self, data: list[dict[str, list]], loss_fn: str, forward_only: bool) -> dict[str, Any]:
        """`data`: each datum's `tokens`, `target_tokens` and `weights`."""
        from trainyard.parallel.runtime.open_loop import Datum

        datums = [Datum(d["tokens"], d["target_tokens"], d["weights"]) for d in data]
        return self._run(lambda rank: rank.forward_backward(datums, loss_fn, forward_only))

    def optim_step(self, adam: dict[str, float]) -> dict[str, Any]:
        return self._run(lambda rank: rank.optim_step(**adam))

    def close(self) -> None:
        if self.rank is not None:
            self.rank.close()
            self.rank = None

    def _run(self, call: Any) -> dict[str, Any]:
        from trainyard.parallel.runtime.open_loop import OpenLoopError

        if self.broken is not None or self.rank is None:
            raise RuntimeError(f"training client {self.model_id} is unusable: {self.broken or 'not set up'}")
        try:
            return call(self.rank)
        except OpenLoopError:
            raise
        except Exception as e:
            self.broken = f"an earlier call failed ({type(e).__name__}: {e})"
            traceback.print_exc(file=sys.stderr)
            raise
