"""PipeDream-2BW (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training"): 1F1B with no flush
between steps and two weight versions per stage, each step's update applied one step late:
w_{t+1} = w_t - lr * g(w_{t-1}). A micro-batch's forward and its backward use the same, stashed, version, so the
next step's forwards can start on a stage while the last step's backwards drain: in steady state a stage never
idles (`steady_state`), at the cost of the one-step delay in the update.

Its compute order within a step is 1F1B's; what differs is that steps do not flush (the bubble a step pays is the
steady state's: `steady_state`, which the plan preview shows) and that the ranks step the weights one version late
(`delays_update`: `parallel.runtime.pipeline.weight_versions`). The planner never picks it (it changes the numbers).
The executor does not overlap steps yet (a step's list runs to its end inside one call): the numbers are 2BW's,
the measured step 1F1B's. Pure: no torch.
"""

from __future__ import annotations

from trainyard.parallel.plan.schedule.kind import Schedule
from trainyard.parallel.plan.schedule.kinds.one_f_one_b import _one_f_one_b_order


def _refuse_2bw(pp: int, m: int, vpp: int) -> str | None:
    if vpp != 1:
        return f"2bw needs vpp=1 (got vpp={vpp}): PipeDream-2BW is 1F1B without a flush"
    return None


SCHEDULE = Schedule("2bw", lambda pp, m, vpp, rank: _one_f_one_b_order(pp, m, rank), _refuse_2bw,
                    flushes=False, delays_update=True)
