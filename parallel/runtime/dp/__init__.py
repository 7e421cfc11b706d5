"""The data-parallel room: gradients summed across the ranks that hold the same parameters, at every ZeRO level.

Owns the gradient reducers (`data_parallel`: `make_reducer`, which picks a sharding strategy's reducer;
`GradientReducer`, bucketed and overlapped with backward; ZeRO-1's `ShardedGradientReducer`; the `Compressor`
protocol the `compression/` room implements), their buckets (`grad_buckets`: their sizes, one bucket's state, how
parameters are split into buckets, the gradients' types on the wire), the sum through shared memory when a group's
ranks are CPU processes on one host (`shm_reduce`), and ZeRO-2/3 with torch's FSDP2 (`fsdp`: `shard_chunks`,
`FsdpReducer`), with what FSDP2 holds gathered while a step runs (`fsdp_meter`), FSDP2 under the zero-bubble
schedules' split backward (`fsdp_split`) and its all-gather and reduce-scatter on gloo without gloo's whole-size
copies (`gloo_comms`). The replicas' other ways to keep in step are `sync/`. Of the runtime, imports only `tp/` (a
DTensor's local part).
"""
