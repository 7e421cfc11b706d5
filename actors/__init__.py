"""The Ray actors: a job's Coordinator and its controller (`coordinator`, `controller`, `state`), the states'
actions (`actions/`), the failure and scaling decisions (`failure_handling/`, `scaling_policy/`) and the ranks
(`worker_group/`); docs/design.md's "actors/ in rooms" says what each owns."""
