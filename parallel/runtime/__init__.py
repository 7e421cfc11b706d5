"""The runtime room: one rank's machinery with torch.distributed alone (no Ray).

Owns the driver a worker actor calls (`driver`), the trainer (`trainer`), the state that moves between
checkpoints, replicas and layouts (`rank_state`), what a step reports (`step_stats`), the pipeline executor
(`pipeline`), the gradient reducers (`data_parallel`) and their compressors (`compression/`), a DTensor's local
part and back (`local_parts`), ZeRO-2/3 with FSDP2 (`fsdp`), tensor and sequence parallelism (`tensor_parallel`),
compile, process groups (`distributed`), the replica sync modes (`sync/`), the optimizer as the trainer drives it
(`train_optimizer`), the local gloo launcher (`local_world`) and the calibration run that measures a machine for
the planner (`calibrate`). May import every other room of `parallel/`; nothing in `parallel/` imports it.
"""
