"""Replicas that fail alone, through the real service (uvicorn, Ray, gloo): a diloco job at dp=4 (no `fault`
section) loses rank 2, the whole of replica 2, at step 10 (a kill_worker drill). Replica 2 is dropped from the
round and the three others go on stepping (the rows' `replica_steps` show their counters moving while replica
2's stands still); it is rebuilt and rejoins in the next outer sync (step 15's) from their state, and the job
SUCCEEDS with every step's row once."""

from __future__ import annotations

from helpers import tiny_spec, wait_for, wait_terminal

STEPS, EVERY, KILLED = 24, 8, 2
SPEC = tiny_spec(steps=STEPS, global_batch=8, name="drop",
                 parallel={"dp": 4, "sync": {"kind": "diloco", "every": EVERY, "outer_lr": 0.7, "outer_momentum": 0.9}})


def test_a_killed_rank_drops_its_replica_the_others_step_on_and_it_rejoins_at_the_next_sync(client):
    job_id = client.submit(SPEC)
    wait_for(lambda: client.job(job_id)["status"] == "RUNNING", 120, "the job to run")
    client._call("POST", f"/api/jobs/{job_id}/faults", json={"kind": "kill_worker", "rank": KILLED, "at_step": 10})
    job = wait_terminal(client, job_id, timeout_s=300)
    assert job["status"] == "SUCCEEDED", job["error"]

    events = client.events(job_id)
    kinds = [e["kind"] for e in events]
    assert "replica_dropped" in kinds and "replica_rejoined" in kinds, events
    dropped, rejoined = (next(e for e in events if e["kind"] == k) for k in ("replica_dropped", "replica_rejoined"))
    failure = next(e for e in events if e["kind"] == "failure")
    assert kinds.count("failure") == 1 and failure["recovered_from"] == "replicas_left" and failure["steps_lost"] == 0
    rejoins = dropped["rejoins_after_step"]  # the next sync: 15, unless the drill came late
    assert dropped["replicas"] == [KILLED] and dropped["ranks"] == [KILLED] and (rejoins + 1) % EVERY == 0
    assert rejoined["replicas"] == [KILLED] and rejoined["step"] == rejoins + 1

    rows = client.metrics(job_id)
    assert [r["step"] for r in rows] == list(range(STEPS))
    counters = {r["step"]: r["replica_steps"] for r in rows}
    out = [s for s, c in counters.items() if c[KILLED] < s + 1]  # the steps replica 2 sat out
    assert len(out) >= 3 and max(out) == rejoins - 1, counters  # in the sync of step `rejoins` it took their state
    standing = {counters[s][KILLED] for s in out}
    assert len(standing) == 1, counters  # replica 2's counter stood still ...
    for s in out:  # ... while the three others' kept moving, one step per row
        assert [c for d, c in enumerate(counters[s]) if d != KILLED] == [s + 1] * 3, counters
    assert rejoined["steps_missed"] == [rejoins + 1 - standing.pop()]
    assert all(c == [s + 1] * 4 for s, c in counters.items() if s not in out), counters
    assert all(r["loss"] > 0 for r in rows)
