"""The job's ranks (Ray Train v2's worker_group/): `worker` (the Worker actor, one per rank, a thin Ray shell around
`parallel.runtime.driver.RankDriver`), `worker_group` (the ranks' actors on their placement-group slots: create,
set up, call, tear down, move between layouts; it decides nothing) and `oom_killer` (how a rank killed by the
kernel's OOM killer is told from other deaths, from the counts of its node's memory cgroup)."""
