"""What happens after which step: a scheduled checkpoint, a validation pass, the end of the job. One home for
each rule: the coordinator's step loop, its recovery, the service's resume and the ranks all ask here.

Steps are 0-based; "after step s" means once s + 1 steps are done.
"""

from __future__ import annotations

from trainyard.parallel.config import JobConfig


def is_done(steps_done: int, steps: int) -> bool:
    """Whether a job of `steps` steps has none left after `steps_done`."""
    return steps_done >= steps


def saves_after(config: JobConfig, step: int) -> bool:
    """Whether step `step` ends with a scheduled checkpoint (`checkpoint.every`). The job's last step is not one:
    its final checkpoint is written when the job finishes (`final_checkpoint`), with the model's export."""
    every = config.checkpoint.every
    return every > 0 and (step + 1) % every == 0 and not is_done(step + 1, config.steps)


def evaluates_after(config: JobConfig, step: int) -> bool:
    """Whether step `step` ends with a validation pass: every `eval.every` steps, and after the last."""
    every = config.eval.every
    return every > 0 and ((step + 1) % every == 0 or step + 1 == config.steps)
