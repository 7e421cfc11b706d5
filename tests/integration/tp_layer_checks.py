"""Each tensor-parallel piece at tp=2 against the same module unsharded, computed inside spawned gloo ranks.

`run_layer_checks(out_dir)` spawns two ranks. Each builds every module twice from one seed, whole and
sharded with `apply_tensor_parallel`, feeds both the same inputs (with sp, the sharded one gets this rank's
sequence slice) and records, per check, the largest relative difference of outputs and gradients (sharded
gradients gathered with `full_tensor`). The tests assert on the records; one spawn serves them all.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from gloo_ranks import spawn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from trainyard.parallel.config import ModelConfig
from trainyard.parallel.models.whole import GPTStage, full_model
from trainyard.parallel.optim.optimizer import clip_grad_norm, tp_copies
from trainyard.parallel.runtime.dp.data_parallel import GradientReducer
from trainyard.parallel.runtime.pipeline.pipeline import _SavedTensorMeter
from trainyard.parallel.runtime.tp.tensor_parallel import apply_tensor_parallel

TP = 2
CFG = ModelConfig(n_layer=2, n_head=4, d_model=32, vocab_size=256, seq_len=16)
LOSS_CFG = ModelConfig(**{**CFG.__dict__, "vocab_size": 1024})
SEED = 11
MAX_NORM = 0.05  # far below the gradient norm, so clipping scales every gradient
Results = dict[str, dict[str, float]]


def run_layer_checks(out_dir: Path) -> list[Results]:
    """Per rank: {check: {quantity: relative difference, or a fact such as a local size}}."""
    spawn(_rank_main, TP, str(out_dir))
    return [torch.load(out_dir / f"layers{r}.pt") for r in range(TP)]


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    mesh = DeviceMesh("cpu", torch.arange(TP), mesh_dim_names=("tp",))
    results: Results = {"init": _check_init(mesh), "tied": _check_model_step(mesh, sp=False, tie=True)}
    for sp in (False, True):
        tag = "sp" if sp else "no-sp"
        for region in ("attn", "mlp", "block"):
            results[f"{region} {tag}"] = _check_region(mesh, region, sp)
        results[f"embedding {tag}"] = _check_embedding(mesh, sp)
        results[f"loss {tag}"] = _check_loss(mesh, sp)
        results[f"model {tag}"] = _check_model_step(mesh, sp, tie=False)
    torch.save(results, Path(out_dir) / f"layers{rank}.pt")
    dist.destroy_process_group()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the largest value of `want`, or to 1e-3 when that is smaller: k's bias
    gradient is mathematically zero (softmax ignores a per-query constant), so it is rounding noise."""
    got = (got.full_tensor() if isinstance(got, DTensor) else got).detach()
    want = want.detach()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-3))


def _seq(t: torch.Tensor, sp: bool) -> torch.Tensor:
    """This rank's sequence slice with sp (what it holds between the parallel regions), all of t without."""
    return t.chunk(TP, dim=1)[dist.get_rank()] if sp else t


def _pair(mesh: DeviceMesh, layers: list[int], *, first: bool, last: bool, sp: bool,
          cfg: ModelConfig = CFG) -> tuple[GPTStage, GPTStage]:
    whole = GPTStage(cfg, layers, first=first, last=last, seed=SEED)
    sharded = GPTStage(cfg, layers, first=first, last=last, seed=SEED)
    return whole, apply_tensor_parallel(sharded, mesh, sequence_parallel=sp)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _tokens(batch: int, seed: int, cfg: ModelConfig = CFG) -> torch.Tensor:
    return torch.randint(cfg.vocab_size, (batch, cfg.seq_len + 1), generator=torch.Generator().manual_seed(seed))


def _param_grads(sharded: torch.nn.Module, whole: torch.nn.Module) -> dict[str, float]:
    want = dict(whole.named_parameters())
    return {f"{name} grad": rel_err(p.grad, want[name].grad) for name, p in sharded.named_parameters()}


def _check_region(mesh: DeviceMesh, region: str, sp: bool) -> dict[str, float]:
    """Attention, MLP or a whole block (its norms sequence-parallel with sp), forward and backward."""
    whole, sharded = _pair(mesh, [0], first=False, last=False, sp=sp)

    def pick(stage: GPTStage) -> torch.nn.Module:
        return stage.blocks["0"] if region == "block" else getattr(stage.blocks["0"], region)

    x, grad_y = _randn(2, CFG.seq_len, CFG.d_model, seed=1), _randn(2, CFG.seq_len, CFG.d_model, seed=2)
    x_whole, x_sharded = x.clone().requires_grad_(), _seq(x, sp).clone().requires_grad_()
    y_whole, y_sharded = pick(whole)(x_whole), pick(sharded)(x_sharded)
    (y_whole * grad_y).sum().backward()
    (y_sharded * _seq(grad_y, sp)).sum().backward()
    out = {"output": rel_err(y_sharded, _seq(y_whole, sp)),
           "input grad": rel_err(x_sharded.grad, _seq(x_whole.grad, sp)),
           **_param_grads(pick(sharded), pick(whole))}
    if region == "attn":
        head_dim = CFG.d_model // CFG.n_head
        out |= {f"local heads {n}": getattr(pick(sharded), n).weight.to_local().shape[0] / head_dim for n in "qkv"}
    return out


def _check_embedding(mesh: DeviceMesh, sp: bool) -> dict[str, float]:
    whole, sharded = _pair(mesh, [0], first=True, last=False, sp=sp)
    tokens = _tokens(2, seed=3)[:, :-1]
    grad_y = _randn(2, CFG.seq_len, CFG.d_model, seed=4)
    y_whole, y_sharded = whole.embed(tokens), sharded.embed(tokens)
    (y_whole * grad_y).sum().backward()
    (y_sharded * _seq(grad_y, sp)).sum().backward()
    return {"output": rel_err(y_sharded, _seq(y_whole, sp)),
            "wte grad": rel_err(sharded.wte.weight.grad, whole.wte.weight.grad),
            # wpe stays a plain tensor: each rank must hold its whole gradient, not a partial sum.
            "wpe grad": rel_err(sharded.wpe.weight.grad, whole.wpe.weight.grad),
            "local vocab rows": sharded.wte.weight.to_local().shape[0]}


def _check_loss(mesh: DeviceMesh, sp: bool) -> dict[str, float]:
    """The final norm, the vocabulary-parallel head and the cross-entropy under loss_parallel, on a head whose
    logits dominate what backward keeps (as a real vocabulary's do), so the saving tp brings shows."""
    whole, sharded = _pair(mesh, [], first=False, last=True, sp=sp, cfg=LOSS_CFG)
    hidden, targets = _randn(2, CFG.seq_len, CFG.d_model, seed=5), _tokens(2, seed=6, cfg=LOSS_CFG)[:, 1:]
    h_whole, h_sharded = hidden.clone().requires_grad_(), _seq(hidden, sp).clone().requires_grad_()
    meter_whole, meter_sharded = (_SavedTensorMeter(list(m.parameters())) for m in (whole, sharded))
    with torch.autograd.graph.saved_tensors_hooks(meter_whole.pack, meter_whole.unpack):
        loss_whole = whole.loss_sum(h_whole, targets)
    loss_whole.backward()
    with loss_parallel():
        with torch.autograd.graph.saved_tensors_hooks(meter_sharded.pack, meter_sharded.unpack):
            loss_sharded = sharded.loss_sum(h_sharded, targets)
        loss_sharded.backward()
        logits = sharded.lm_head(sharded.ln_f(h_sharded.detach()))
    return {"loss": rel_err(loss_sharded, loss_whole), "hidden grad": rel_err(h_sharded.grad, _seq(h_whole.grad, sp)),
            **_param_grads(sharded, whole), "local logits width": logits.to_local().shape[-1],
            "saved bytes ratio": meter_sharded.peak / meter_whole.peak}


def _check_init(mesh: DeviceMesh) -> dict[str, float]:
    """A stage built at tp=2 holds, gathered, exactly the tp=1 weights (counts of parameters)."""
    whole, sharded = full_model(CFG, seed=SEED), apply_tensor_parallel(full_model(CFG, seed=SEED), mesh,
                                                                       sequence_parallel=True)
    want = dict(whole.named_parameters())
    got = dict(sharded.named_parameters())
    equal = [torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, want[n]) for n, p in got.items()]
    sharded_count = sum(isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements) for p in got.values())
    return {"parameters": len(got), "expected parameters": len(want), "equal": sum(equal), "sharded": sharded_count}


def _check_model_step(mesh: DeviceMesh, sp: bool, tie: bool) -> dict[str, float]:
    """The whole model, two micro-batches accumulated into gradient buckets, then clipped."""
    cfg = ModelConfig(**{**CFG.__dict__, "tie_embeddings": tie})
    whole, sharded = _pair(mesh, list(range(cfg.n_layer)), first=True, last=True, sp=sp, cfg=cfg)
    out: dict[str, float] = {}
    if tie:
        out["tied"] = float(sharded.lm_head.weight is sharded.wte.weight)
    buckets = GradientReducer([list(sharded.parameters())], None)
    for mb in range(2):
        tokens = _tokens(2, seed=10 + mb)
        loss_whole = whole.loss_sum(whole(tokens[:, :-1]), tokens[:, 1:])
        loss_whole.backward()
        with loss_parallel():
            loss_sharded = sharded.loss_sum(sharded(tokens[:, :-1]), tokens[:, 1:])
            loss_sharded.backward()
        out[f"loss {mb}"] = rel_err(loss_sharded, loss_whole)
    # Autograd must have accumulated into the buckets, not replaced the views.
    out["grads in buckets"] = float(all(_in(p.grad, [b.flat for b in buckets.buckets]) for p in sharded.parameters()))
    norm_whole = float(clip_grad_norm([(p.grad, 1.0) for p in whole.parameters()], MAX_NORM))
    sharded_grads = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, 1 / tp_copies(p, TP))
                     for p in sharded.parameters()]
    norm_sharded = float(clip_grad_norm(sharded_grads, MAX_NORM, mesh.get_group()))
    out |= {"norm": abs(norm_sharded - norm_whole) / norm_whole, "unclipped norm": norm_whole}
    return out | {f"clipped {k}": v for k, v in _param_grads(sharded, whole).items()}


def _in(grad: torch.Tensor, buckets: list[torch.Tensor]) -> bool:
    ptr = (grad.to_local() if isinstance(grad, DTensor) else grad).data_ptr()
    return any(b.data_ptr() <= ptr < b.data_ptr() + b.numel() * b.element_size() for b in buckets)
