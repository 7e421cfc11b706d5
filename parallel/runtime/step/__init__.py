"""The step room: what one training step reads besides its model and what it reports.

Owns the step's inputs (`step_inputs`: the micro-batches, packed data's documents, the loss's scale, autocast), its
figures on their way to the host one step late (`step_figures`) and the step's report as data (`step_stats`:
`StepStats`, `StepReport`, `Save`, `DivergedError`; no torch, as the coordinator reads them) and the metrics row the
coordinator makes of the reports (`step_row`: `StepRow`, which the REST API serves). Of the runtime, imports
only `pipeline/` (the executor's batches and timings).
"""
