"""An experiment, not a bench section: is it PowerSGD's one warm-started power iteration per step that costs the
rank-4 loss under AdamW (BENCHMARKS.md, section savers_grads), or the rank itself?

Run: `PYTHONPATH=$PWD python -m bench.powersgd_iterations [STEPS [ITERATIONS...]]` (default 400 steps, 1 2 4 8).
The demo job at dp=2, rank 4, 10 warm-up steps, once per iteration count, beside the uncompressed job, in one
spawned gloo world. With k iterations a step runs k rounds of P = (sum_i M_i) Q, orthonormalise, Q = (sum_i
M_i)^T P^ on the summed gradient (2k all-reduces), so at k = 8, warm-started, P^ Q^T is the best rank-r
approximation of the sum to within the power method's convergence; the error feedback is as the product's
(each rank keeps what its own gradient lost in the final projection). With k = 1 it is the product's reducer
(the same losses to the last digit). The product keeps k = 1 (the paper's and torch's hook's choice); this only
patches the reducer inside the spawned ranks.
"""

from __future__ import annotations

import functools
import statistics
import sys

import torch
import torch.distributed as dist

from bench.savers_grads import POWERSGD, TAIL, _losses, _plan


def _iterated_finish(self, iterations: int) -> int:
    """`PowerSGDReducer._finish_compressed` with `iterations` power iterations on the summed gradient,
    synchronously (the bytes it reports: 0, this measures loss only)."""
    for index, b in enumerate(self.buckets):
        st = self._states[index]
        self._wait(b, st)
        ps = list(torch.split(st.p_wire, [m.p.numel() for m in st.matrices])) if st.matrices else []
        for it in range(iterations):
            hats = [torch.linalg.qr(p.view_as(m.p)).Q for p, m in zip(ps, st.matrices, strict=True)]
            local = [self._matrix(b, m).T @ hat for m, hat in zip(st.matrices, hats, strict=True)]
            q_sum = _all_reduced(local, self.group)
            if it + 1 < iterations:
                ps = _all_reduced([self._matrix(b, m) @ q for m, q in zip(st.matrices, q_sum, strict=True)],
                                  self.group)
        for m, hat, q_local, q in zip(st.matrices, hats if st.matrices else [], local if st.matrices else [],
                                      q_sum if st.matrices else [], strict=True):
            grad = self._matrix(b, m)
            m.error.copy_(grad - hat @ q_local.T)
            grad.copy_(hat @ q.T)
            m.q, m.p = q.clone(), None
        st.q_wire = st.p_wire = st.rest_wire = None
        self._keep_reduced(b)
    return 0


def _all_reduced(tensors: list[torch.Tensor], group) -> list[torch.Tensor]:
    wire = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(wire, group=group)
    return [w.view_as(t) for w, t in zip(torch.split(wire, [t.numel() for t in tensors]), tensors, strict=True)]


def patch(iterations: int) -> None:
    """Run in each rank before its trainer is built: the reducer does `iterations` power iterations a step."""
    from trainyard.parallel.runtime.compression.powersgd import PowerSGDReducer

    PowerSGDReducer._finish_compressed = functools.partialmethod(_iterated_finish, iterations=iterations)


def main(argv: list[str]) -> int:
    from trainyard.parallel.runtime.local_world import PlanRun, run_plans

    steps = int(argv[0]) if argv else 400
    counts = [int(a) for a in argv[1:]] or [1, 2, 4, 8]
    runs = [PlanRun(_plan(steps))] + [PlanRun(_plan(steps, parallel={"grad_compression": POWERSGD}),
                                              setup=functools.partial(patch, k)) for k in counts]
    results = run_plans(runs)
    plain = statistics.mean(_losses(results[0])[-TAIL:])
    print(f"uncompressed: loss (mean of the last {TAIL} steps) {plain:.4f}")
    for k, result in zip(counts, results[1:], strict=True):
        loss = statistics.mean(_losses(result)[-TAIL:])
        print(f"rank {POWERSGD['rank']}, {k} power iteration(s) a step: {loss:.4f} ({loss / plain - 1:+.1%})",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
