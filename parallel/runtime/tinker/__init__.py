"""The Tinker room: what a rank of the Tinker-compatible API's open loop (`parallel.runtime.open_loop`, at the top)
needs beyond a job's rank.

- `losses`: Tinker's documented losses (cross_entropy, importance_sampling, ppo, cispo, dro) on a datum's
  logprobs, and their configs.
- `tenants`: several LoRA clients of one base on one built rank, each with its own adapters, gradients, optimizer
  state, step count and sampler snapshots, swapped in by each call.

Imports the `sampling` and `tp` rooms, and not the runtime's top.
"""
