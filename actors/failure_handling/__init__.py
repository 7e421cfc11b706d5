"""What the coordinator does about a failure (Ray Train v2's failure_handling/), apart from the state machine that
applies it (`actors.state`). Each policy reads nothing but its arguments and returns a decision with its reason, so
the tests drive them directly.

- `policy`: the `FailurePolicy` protocol (a failure is recovered from, ridden or ends the job) and its decisions.
- `registry`: the failure policies by name, and the job's (`failure_policy`); `default` is today's policy (the
  `fault.max_failures` budget; an elastic job rides a lost node). A new policy is one module here and one line in
  the registry.
- `hang`: how long a step may take before it counts as hung (`HangPolicy`).
- `replicas`: after a failure, which live data-parallel replica gives each rank its state, which ranks are replaced
  so that none stays blocked on a dead peer, and which replicas are dropped from the round (local_sgd, diloco).
"""
