"""`parallel.optim.dynamo_free`: the trainer's optimizers build and step without importing torch._dynamo (1.1 s of every
rank process's CPU), and give torch's optimizers' bits, before dynamo is imported and after (then torch's own
wrappers run). In a fresh interpreter: the test process has imported dynamo long before."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
import torch
from trainyard.parallel.optim import dynamo_free
from trainyard.parallel.optim.adafactor import Adafactor

def run(make, steps=4):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    optimizer = make([{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}])
    for step in range(steps):
        loss = sum(((p - step) ** 2).sum() for p in params)
        loss.backward()
        with torch.no_grad():  # as the trainer steps
            optimizer.step()
        for p in params:
            p.grad = None
    return [p.detach().clone() for p in params]

ours = {
    "adamw": lambda g: dynamo_free.AdamW(g, lr=0.1, betas=(0.9, 0.95), foreach=True),
    "sgd": lambda g: dynamo_free.SGD(g, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
    "adafactor": lambda g: Adafactor(g, lr=0.1, scale_parameter=True),
}
torchs = {
    "adamw": lambda g: torch.optim.AdamW(g, lr=0.1, betas=(0.9, 0.95), foreach=True),
    "sgd": lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True, foreach=True),
}
before = {name: run(make) for name, make in ours.items()}
assert "torch._dynamo" not in sys.modules, "building or stepping imported torch._dynamo"
import torch._dynamo  # from here on torch's wrappers run, for theirs and ours alike
after = {name: run(make) for name, make in ours.items()}
for name, make in torchs.items():
    theirs = run(make)
    assert all(torch.equal(a, b) for a, b in zip(before[name], theirs)), name
for name in ours:
    assert all(torch.equal(a, b) for a, b in zip(before[name], after[name])), name
    assert not all(torch.equal(a, b) for a, b in zip(before[name], run(lambda g: ours[name](g), steps=0))), name
print("ok")
"""


def test_optimizers_step_without_dynamo_and_give_torchs_bits():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
