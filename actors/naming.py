"""Ray actor names and the namespace, as docs/design.md ("Names") fixes them."""

NAMESPACE = "trainyard"


def coordinator_name(job_id: str) -> str:
    return f"trainyard/{job_id}/coordinator"


def worker_name(job_id: str, coords: str) -> str:
    """`coords` is the plan's `pp<i>-tp<j>-dp<k>`."""
    return f"trainyard/{job_id}/{coords}"


def placement_group_name(job_id: str) -> str:
    return f"trainyard/{job_id}"


def ps_shard_name(job_id: str, shard: int) -> str:
    """A parameter-server shard (`parallel.sync.kind: parameter_server`)."""
    return f"trainyard/{job_id}/ps{shard}"
