"""The pipeline room: one pipeline rank's part of a step, as the plan's schedule lists it.

Owns the executor (`pipeline`: the action list interpreted through one table, `HANDLERS`; the activations sent and
received), how it times its actions (`stage_clock`: the device's clock on a GPU), a chunk's backward in two halves
for the zero-bubble schedules (`split_backward`) and the tied embeddings kept equal across pipeline chunks (`tied`).
The schedules themselves are the plan's (`parallel.plan.schedules`). Of the runtime, imports only `dp/` (FSDP2's
sharded chunks, gathered as the actions ask) and `tp/` (a DTensor's local part).
"""
