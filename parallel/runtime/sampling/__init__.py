"""The sampling room: generation on a built rank's own model, for the Tinker-compatible API's sampling clients.

- `params`: what a sample asks for (Tinker's `SampleRequest` and `SamplingParams`), checked, naming the field of
  what is wrong; the model's implicit stop tokens. No torch: the service checks a request with it before any rank
  runs, and the rank again.
- `kv_cache`: the model as generation calls it, a prefill then one token at a time, with a KV cache: for the native
  families, the stage's own modules stepped with cached keys and values; for the transformers backend, its own
  cache; for an attention it does not know, the prefix recomputed each token.
- `generate`: greedy or sampled decoding (temperature, top-k, top-p, seeded), stop tokens and strings, each token's
  logprob, the prompt's logprobs and top-k.
- `snapshots`: named copies of a training client's trainable weights, swapped in for a sample (a sampler at a
  named save point) and back.
- `sampler`: one rank's sampler, the above assembled on a built model (`parallel.runtime.open_loop` holds one;
  `trainyard generate` runs one on a downloaded model).

Imports no other runtime room and not the runtime's top (`open_loop` uses it).
"""
