"""The planner's answer explained: why each runner-up lost to the winner (the step's term where it loses most: the
bubble, a collective, the cp ring's exchanges, ...), and, when no layout fits, what the smallest one found needs,
what the search tried (the options, the cp degrees, or the rule that kept it at cp = 1) and what would make it fit
(more nodes, a leaner optimizer). Pure: no torch.
"""

from __future__ import annotations

import math
from dataclasses import replace

from trainyard.parallel.config import JobConfig
from trainyard.parallel.optim.kinds import OPTIMIZERS, optimizer_kind
from trainyard.parallel.plan.admission import ClusterResources
from trainyard.parallel.plan.planner.planner_search import Search
from trainyard.parallel.plan.planner.prediction import Candidate
from trainyard.parallel.plan.planner.search_options import searched_values
from trainyard.parallel.plan.rules import PlanError, violations
from trainyard.parallel.plan.sizing import fixed_parallel
from trainyard.parallel.plan.units import format_size


def distinct(found: list[Candidate]) -> list[Candidate]:
    """One of each set of layouts that differ only in a schedule that cannot matter (one pipeline rank)."""
    seen, out = set(), []
    for c in found:
        summary = c.layout_summary()
        if fixed_parallel(c.config).pp == 1:
            summary["schedule"] = ""
        key = tuple(summary.items())
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def why_lost(c: Candidate, best: Candidate) -> str:
    """The part of the step where the runner-up loses most to the winner."""
    if c.step_s <= best.step_s:
        return f"same predicted step time; more memory per rank ({format_size(c.memory_bytes)} vs " \
               f"{format_size(best.memory_bytes)})"
    name = max(set(c.terms) | set(best.terms), key=lambda k: c.terms.get(k, 0.0) - best.terms.get(k, 0.0))
    if name == "bubble":
        return f"bubble {c.bubble:.0%} vs {best.bubble:.0%} ({_ms(c.terms['bubble'] - best.terms['bubble'])} more)"
    more = c.terms.get(name, 0.0) - best.terms.get(name, 0.0)
    return f"{name} {_ms(more)}/step more"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def no_fit_error(config: JobConfig, cluster: ClusterResources, search: Search) -> PlanError:
    if search.smallest is None:
        one_rank = replace(fixed_parallel(config), dp=1, pp=1, tp=1, ep=1, vpp=1, sp=False, microbatches=1,
                           schedule="1f1b", stage_layers=None)
        broken = violations(replace(config, parallel=one_rank))
        if broken:  # a rule no layout can keep (the model's, the data's, the options'): named as a layout names it
            return broken[0]
        return PlanError("parallel", f"no layout keeps the rules on this cluster ({len(cluster.nodes)} node(s), "
                                     f"{cluster.gpus:g} GPU, {cluster.cpus:g} CPU): check global_batch, n_head and "
                                     "n_layer against the cluster's size")
    memory, smallest = search.smallest
    layout = search.layout(smallest)
    have = search.rank_capacity(layout) * (1 - search.margin)
    par = fixed_parallel(smallest)
    nodes = math.ceil(len(cluster.nodes) * memory / max(have, 1.0))
    fixes = [f"more nodes (about {nodes} of this kind, if the model splits that far)"]
    kind = optimizer_kind(config.optimizer)
    d, n = config.model.d_model, 10**6  # state bytes per parameter, over a million parameters
    per_param = {name: o.state_bytes(n, d) / n for name, o in OPTIMIZERS.items()}
    fixes += [f"optimizer.kind: {name} (about {b:.2g} B of state per parameter instead of {per_param[kind.name]:.2g})"
              for name, b in per_param.items() if b < per_param[kind.name]]
    tried = [f"{path} in {list(values)}" for path, values in searched_values(config).items()]
    if len(search.cps) > 1:
        tried.append(f"parallel.cp in {search.cps}")
    elif search.cp_refused is not None:  # a long sequence's activations: what cp would have split
        tried.append(f"parallel.cp at 1 only ({search.cp_refused.message})")
    return PlanError("parallel", f"no layout fits: the smallest per-rank memory found is {format_size(memory)} "
                                 f"(dp={par.dp} cp={par.cp} pp={par.pp} tp={par.tp} microbatches={par.microbatches}) "
                                 "but a rank "
                                 f"may hold {format_size(have)} ({search.margin:.0%} kept free); would fit with: "
                                 + "; ".join(fixes) + " (the search already tried " + ", ".join(tried) + ")")
