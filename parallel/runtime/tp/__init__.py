"""The tensor-parallel room: a stage's parameters as DTensors.

Owns tensor and sequence parallelism (`tensor_parallel`: `apply_tensor_parallel` by the family's plan, the loss
under `loss_parallel`, what a stage sends with sequence parallelism) and a rank's part of any DTensor, tensor-parallel
or FSDP2-sharded, and back (`local_parts`), which the rest of the runtime reads. Imports no other room of the
runtime: every one may import it.
"""
