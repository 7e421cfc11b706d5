"""One rank's step opened to an outside driver (the Tinker-compatible API): `forward_backward` on the caller's token
sequences with their per-token weights, gradients accumulating over calls, and `optim_step`, which applies them with
the caller's Adam parameters; its state saved and loaded as a job's checkpoints are (`save_state`, `load_state`:
DCP, any layout loading any). The rank is built as a job's is (`RankDriver`, `RankTrainer`: `build_rank`'s order,
LoRA, the reducers, the optimizer); only the step is split in two.

This is the one module of the open loop that reads the trainer's internals (its chunks, reducers, optimizer and
autocast), so that a move inside `parallel/runtime/` touches one file. No Ray here.

The layouts: data parallelism (ZeRO-1 shards the optimizer state and the summed gradients, its reducers gathering
the parameters after the step) over replicas that are each one rank or a tensor-parallel group (tp ranks, each
holding its heads and its share of the vocabulary: the head's logits stay sharded, and each target's logprob is the
negative of the cross-entropy under `loss_parallel`, which also wraps the backward, so the full logits never exist
on one rank). Each replica runs its share of a call's datums (`shares`; every rank of a replica the same ones), and
the gradient reducers sum the replicas' gradients at `optim_step`, so the step is the one of every datum's loss
summed, whatever the layout. Pipeline, expert and context parallelism, sequence parallelism and ZeRO-2/3 are
refused, naming the field (`layout_violation`).
Losses: Tinker's documented ones (`parallel.runtime.tinker.losses`: cross_entropy, importance_sampling, ppo, cispo,
dro); the others are refused, naming `loss_fn`.

Sampling (`save_for_sampler`, `sample`): the rank's own model generates (`parallel.runtime.sampling.Sampler`), at its
live weights or at a named snapshot of its trainable weights taken in memory: a sampling client of a training
client's save point is served by the client's own ranks (the first replica's: under tp its ranks generate in
lockstep, each token drawn from the same gathered logits with the same seed), no file written.

Tenants (`parallel.runtime.tinker.tenants`): LoRA clients of the same base at the same layout share the rank, each call
naming its tenant (`tenant`; None: the live one), which the rank swaps in first: the base is held once, and each
tenant's adapters, gradients, optimizer state, step count and sampler snapshots are its own (`add_tenant`,
`drop_tenant`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from trainyard.parallel.io import checkpoint
from trainyard.parallel.optim.optimizer import clip_grad_norm, set_lr
from trainyard.parallel.plan import Plan
from trainyard.parallel.runtime.driver import RankDriver
from trainyard.parallel.runtime.sampling.sampler import Sampler
from trainyard.parallel.runtime.tinker.losses import INPUTS, LOSSES, config_of
from trainyard.parallel.runtime.tinker.tenants import TenantError, Tenants
from trainyard.parallel.runtime.tp.tensor_parallel import loss_context


class OpenLoopError(ValueError):
    """A call this rank cannot run as asked (the caller's error, not the rank's): its message names the field."""


@dataclass(frozen=True)
class Datum:
    """One sequence of a call: the model's input tokens, the target of each position, and the loss's other inputs
    by their Tinker names (`weights`; `logprobs`, `advantages`), all as long as the input."""

    tokens: list[int]
    targets: list[int]
    inputs: dict[str, list[float]]


def datum_of(d: Mapping[str, list]) -> Datum:
    """A datum as the API hands it over: `tokens`, `target_tokens` and the loss's other inputs by name."""
    return Datum(list(d["tokens"]), list(d["target_tokens"]),
                 {k: list(v) for k, v in d.items() if k not in ("tokens", "target_tokens")})


LAYOUT_RULE = "a training client runs data-parallel replicas of one rank or one tensor-parallel group so far " \
              "(pp = ep = cp = 1, sp off, zero 0 or 1)"


def layout_violation(plan: Plan) -> str | None:
    """The field of `plan` the open loop cannot run (`LAYOUT_RULE`), or None."""
    for field, bad in (("parallel.pp", plan.pp != 1), ("parallel.ep", plan.ep != 1),
                       ("parallel.sp", plan.parallel.sp), ("parallel.zero", plan.parallel.zero > 1),
                       ("parallel.cp", plan.cp != 1)):  # the open loop's data and sampling know no cp split
        if bad:
            return field
    return None


def check_layout(plan: Plan) -> None:
    """The layouts the open loop runs (`LAYOUT_RULE`)."""
    field = layout_violation(plan)
    if field is not None:
        raise OpenLoopError(f"{field}: {LAYOUT_RULE}")


def check_call(data: list[Datum], loss_fn: str, seq_len: int, config: Mapping[str, float] | None = None
               ) -> dict[str, float]:
    """A forward_backward's input as the rank runs it, and the loss's config (its defaults filled in);
    OpenLoopError naming the field otherwise."""
    if loss_fn not in LOSSES:
        raise OpenLoopError(f"loss_fn: not one of {', '.join(LOSSES)} (the others are not built yet)")
    try:
        full = config_of(loss_fn, config)
    except ValueError as e:
        raise OpenLoopError(str(e)) from None
    for i, d in enumerate(data):
        if not 0 < len(d.tokens) <= seq_len or len(d.targets) != len(d.tokens):
            raise OpenLoopError(f"data[{i}]: needs 1 to {seq_len} input tokens and as many target_tokens")
        for name in INPUTS[loss_fn]:
            if len(d.inputs.get(name, ())) != len(d.tokens):
                raise OpenLoopError(f"data[{i}].loss_fn_inputs.{name}: {loss_fn} needs one per input token")
    return full


def batches(lengths: list[int], tokens: int) -> list[range]:
    """The datums of a call in forwards of at most `tokens` padded positions each (rows x the longest), in order;
    a datum alone may fill one."""
    out: list[range] = []
    start, longest = 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i - start + 1) * max(longest, n) > tokens:
            out.append(range(start, i))
            start, longest = i, 0
        longest = max(longest, n)
    if lengths:
        out.append(range(start, len(lengths)))
    return out


def shares(n: int, dp: int) -> list[range]:
    """Which of `n` datums each of `dp` replicas runs: contiguous, as even as can be (some may run none)."""
    return [range(r * n // dp, (r + 1) * n // dp) for r in range(dp)]


class OpenLoopRank:
    """A built rank (`RankDriver`) stepped by calls: `forward_backward` accumulates, `optim_step` applies."""

    def __init__(self, driver: RankDriver, tenant: str = "default"):
        check_layout(driver.plan)
        self.driver, self.trainer = driver, driver.trainer
        [self.chunk] = self.trainer.chunks
        self.head: Any = getattr(self.chunk, "logits", None)
        """The hf backend's head (hidden -> logits); None: a native family's `ln_f`, then `lm_head`."""
        self.loss_context = loss_context(driver.plan)
        """`loss_parallel` under tp (the logits sharded over the vocabulary), around the loss and its backward."""
        self.seq_len = driver.plan.config.model.seq_len
        self.forward_tokens = driver.plan.micro_batch_size * self.seq_len
        """The most positions one forward holds (rows x the longest datum): the plan's micro-batch, which the
        memory plan counted (`service.tinker.specs.FORWARD_TOKENS`)."""
        self.decays = [bool(g.get("weight_decay", 0.0)) for g in self.trainer.optimizer.param_groups]
        """Which optimizer groups take weight decay (the job's rule: matrices, not biases or norms)."""
        cfg = driver.plan.config
        self.sampler = Sampler(self.chunk, self.trainer.device, self.seq_len, cfg.model.vocab_size,
                               cfg.init_from.hf if cfg.init_from is not None else None, self.trainer.executor.autocast)
        """The rank's generation, and the sampler snapshots of its weights (`save_for_sampler`, `sample`)."""
        self.tenants = Tenants(self.trainer, self.sampler, tenant)
        """The LoRA clients sharing this rank's base (`parallel.runtime.tinker.tenants`), `tenant` the first; each call
        names its own (None: the live one)."""

    @property
    def pending(self) -> bool:
        """The live tenant accumulated gradients since its last `optim_step`."""
        return self.tenants.now.pending

    @property
    def steps(self) -> int:
        """The live tenant's optimizer steps."""
        return self.tenants.now.steps

    def add_tenant(self, name: str, seed: int) -> dict[str, Any]:
        """A new tenant on this rank's base, as a new client starts (fresh adapters from `seed`, step 0)."""
        try:
            self.tenants.add(name, seed)
        except ValueError as e:
            raise OpenLoopError(str(e)) from None
        return {"tenants": self.tenants.names}

    def drop_tenant(self, name: str) -> dict[str, Any]:
        """Tenant `name`'s state forgotten (the others', the base and the rank's build kept)."""
        self.tenants.drop(name)
        return {"tenants": self.tenants.names}

    def _use(self, tenant: str | None) -> None:
        try:
            self.tenants.activate(tenant)
        except TenantError as e:
            raise OpenLoopError(f"model_id: {e.args[0]}") from None

    def forward_backward(self, data: list[Datum], loss_fn: str, forward_only: bool = False,
                         config: Mapping[str, float] | None = None, tenant: str | None = None) -> dict[str, Any]:
        """The loss of each datum (`parallel.runtime.tinker.losses`; its gradient accumulated unless
        `forward_only`): `logprobs`, per datum the log-probability of each target, and `metrics` (`loss:sum`)."""
        full = check_call(data, loss_fn, self.seq_len, config)
        self._use(tenant)
        loss_of = LOSSES[loss_fn]
        if not forward_only and not self.pending:
            for reducer in self.trainer.reducers.values():
                reducer.zero_grad()
            self.tenants.now.pending = True
        logprobs, total = [], 0.0
        for group in batches([len(d.tokens) for d in data], self.forward_tokens):
            rows = [data[i] for i in group]
            with torch.set_grad_enabled(not forward_only), self.loss_context():
                picked = self._logprobs(rows)
                losses = [loss_of(lp, {name: torch.tensor(d.inputs[name], dtype=lp.dtype, device=lp.device)
                                       for name in INPUTS[loss_fn]}, full) for d, lp in zip(rows, picked, strict=True)]
                loss = torch.stack(losses).sum()
                if not forward_only:
                    loss.backward()
            logprobs += [lp.detach().float().cpu().tolist() for lp in picked]
            total += sum(float(x.detach()) for x in losses)
        return {"logprobs": logprobs, "metrics": {"loss:sum": total}}

    def optim_step(self, learning_rate: float, beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-12,
                   weight_decay: float = 0.0, grad_clip_norm: float = 0.0, tenant: str | None = None
                   ) -> dict[str, Any]:
        """The accumulated gradients applied (none accumulated: the step is still taken on zero gradients, as
        Tinker's does); the next `forward_backward` starts a new accumulation. `metrics`: the gradient norm."""
        self._use(tenant)
        trainer = self.trainer
        if not self.pending:
            for reducer in trainer.reducers.values():
                reducer.zero_grad()
        for reducer in trainer.reducers.values():
            reducer.finish()
        trainer.optimizer.settle()
        weighted, group = trainer._norm_inputs()
        norm = clip_grad_norm(weighted, grad_clip_norm, group)  # 0: no clipping, as Tinker's
        set_lr(trainer.optimizer, learning_rate)
        for g, decays in zip(trainer.optimizer.param_groups, self.decays, strict=True):
            if "betas" in g:
                g["betas"] = (beta1, beta2)
            g.update({k: v for k, v in (("eps", eps), ("weight_decay", weight_decay if decays else 0.0)) if k in g})
        trainer.optimizer.step()
        for reducer in trainer.reducers.values():
            reducer.gather_params()
        now = self.tenants.now
        now.pending, now.steps = False, now.steps + 1
        return {"metrics": {"grad_norm:mean": float(norm)}, "steps": self.steps}

    def save_state(self, root: str, info: dict, tenant: str | None = None) -> dict[str, Any]:
        """The adapters and their optimizer state as a DCP checkpoint under `root` (`step_<optim steps>`, with `info`
        in its manifest), as a job's (`RankTrainer.save_checkpoint`; collective); the checkpoints of other steps
        under it removed (a save over one of the same name). Gradients being accumulated are not saved."""
        self._use(tenant)
        self.trainer.save_checkpoint(Path(root), self.steps, info)
        if self.driver.rank == 0:
            checkpoint.prune(Path(root), 1, self.steps)
        return {"steps": self.steps}

    def load_state(self, directory: str, step: int, optimizer: bool, tenant: str | None = None) -> dict[str, Any]:
        """The adapters from the checkpoint of `step` in `directory`, whatever layout wrote it (DCP reshards); with
        `optimizer` their optimizer state and step count too, else the optimizer starts afresh (its moments zero,
        its step 0, as a new client's). Gradients being accumulated are dropped."""
        self._use(tenant)
        trainer, now = self.trainer, self.tenants.now
        trainer.load_checkpoint(Path(directory), step)
        now.steps = step
        if not optimizer:
            kept = trainer.local_state()
            for moments in kept["optim"].values():
                for t in moments.values():
                    t.zero_()
            trainer.adopt_state(kept, 0, None)
            now.steps = 0
        now.pending = False
        return {"steps": self.steps}

    def save_for_sampler(self, name: str, drop: list[str] | None = None, tenant: str | None = None
                         ) -> dict[str, Any]:
        """The trainable weights now, kept in memory as sampler weights `name` (those in `drop` forgotten)."""
        self._use(tenant)
        return self.sampler.save(name, drop or ())

    def sample(self, request: dict[str, Any], name: str | None = None, tenant: str | None = None
               ) -> dict[str, Any]:
        """A Tinker sample (`parallel.runtime.sampling.sampler.Sampler.sample`) at sampler weights `name` (None:
        the live weights); OpenLoopError naming the field for a request it cannot serve."""
        from trainyard.parallel.runtime.sampling.params import SampleError

        self._use(tenant)
        try:
            return self.sampler.sample(request, name)
        except SampleError as e:
            raise OpenLoopError(str(e)) from None

    def _logprobs(self, rows: list[Datum]) -> list[torch.Tensor]:
        """Each datum's log-probability of each of its targets, in fp32: the datums in one forward, padded on the
        right to the longest (causal attention: a position sees none of the padding after it)."""
        device, width = self.trainer.device, max(len(d.tokens) for d in rows)
        x = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        targets = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        for i, d in enumerate(rows):
            x[i, :len(d.tokens)] = torch.tensor(d.tokens, dtype=torch.long)
            targets[i, :len(d.targets)] = torch.tensor(d.targets, dtype=torch.long)
        with self.trainer.executor.autocast():
            hidden = self.chunk(x)
            logits = self.head(hidden) if self.head is not None else self.chunk.lm_head(self.chunk.ln_f(hidden))
        if isinstance(logits, DTensor):  # tp: sharded over the vocabulary, under `loss_parallel`
            picked = -F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
            picked = (picked.to_local() if isinstance(picked, DTensor) else picked).view(len(rows), width)
        else:
            picked = torch.log_softmax(logits.float(), dim=-1).gather(2, targets[..., None])[..., 0]
        return [picked[i, :len(d.tokens)] for i, d in enumerate(rows)]

    def close(self) -> None:
        self.driver.close()
