"""The I/O room: sharded DCP checkpoints (`checkpoint`), Hugging Face directories in and out (`hf_spec` at
submit, `hf_checkpoint` for tensors) and the consolidated export (`export`). May import `parallel.config`,
`parallel.models` and `parallel.plan`.
"""
