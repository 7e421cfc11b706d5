"""The replica sync's pure side (`parallel.sync`): what each mode is to the plan (`replica_sync`: `SYNC_KINDS`, when
replicas sync and what it costs), gossip's choice of peers by (seed, step) (`gossip_peers`), and the parameter
server's clock and shard map (`parameter_server`). How a mode runs on a rank is `parallel.runtime.sync`. No torch."""
