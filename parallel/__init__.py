"""The rank's machinery and the plan, in rooms (each room's `__init__` says what it owns and may import):

- `config` (this folder): the JobSpec as frozen dataclasses, read by the service and the ranks alike;
  `seeds`: every random stream from (job seed, name); `names`: the names each registry is keyed by, which the
  config's fields take (one list of each).
- `models/`: the model families behind one registry, their shared layers (decoder, MoE) and Hugging Face names.
- `optim/`: the optimizer kinds, the learning-rate schedule and clipping.
- `plan/`: torch-free: layout, rules, admission, memory plan, schedules, simulator, cost model, planner.
- `data/`: datasets, the sampler and `trainyard prepare`.
- `io/`: checkpoints, Hugging Face in and out, export.
- `runtime/`: one rank with torch.distributed: driver, trainer, pipeline, reducers, FSDP, TP/SP, compile.

A room imports only the rooms listed before it (and `plan/` no torch); `tests/unit/test_imports.py` holds
that. Nothing here imports Ray, FastAPI or the service.
"""
