"""The runtime room: one rank's machinery with torch.distributed alone (no Ray).

At the top, what a newcomer reads first: the driver a worker actor calls (`driver`), the trainer and its step
(`trainer`), the rank's build in one fixed order (`build`, with construction on the meta device, `materialize`, and
regional compilation, `compile`), the state that moves between checkpoints, replicas and layouts (`rank_state`),
process groups (`distributed`), the optimizer as the trainer drives it (`train_optimizer`, with the offloaded host
steps, `host_steps`), the rank's host memory (`host_memory`), the local gloo launcher (`local_world`) and the
calibration run that measures a machine for the planner (`calibrate`).

Each technique is a room of its own, whose `__init__.py` says what it owns:
- `tp/`: tensor and sequence parallelism, and a rank's part of any DTensor (`local_parts`);
- `dp/`: the gradient reducers of every ZeRO level (bucketed and overlapped, ZeRO-1, through shared memory on one
  host; ZeRO-2/3 with FSDP2);
- `compression/`: the reducers' compressors (`COMPRESSORS`);
- `sync/`: the replica sync modes (`SYNCS`);
- `pipeline/`: the pipeline executor, its clock, the split backward, tied embeddings across stages;
- `step/`: what a step reads and what it reports (`step_stats`: torch-free, the coordinator reads it);
- `sampling/`: generation on a built model with a KV cache, for the Tinker API's sampling clients (its `params`:
  torch-free, the service checks a request with it);
- `tinker/`: the Tinker API's losses, and the tenants that share one rank's base (`open_loop`, at the top, uses it).

The top assembles the rooms and no room imports the top; the rooms import each other without a circle (`tp/`, `sync/`
and `sampling/` none, `dp/` `tp/`, `compression/` `dp/` and `tp/`, `pipeline/` `dp/` and `tp/`, `step/` `pipeline/`,
`tinker/` `sampling/` and `tp/`). May import every other room of `parallel/`; nothing in `parallel/` imports it.
"""
