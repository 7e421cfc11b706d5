"""The actions the controller's states ask for (`actors.controller` runs one each pass), each a part that owns its
own state and is handed only the few pieces of the job it works on (the worker group, the progress, the rows, the
journal...), never the controller:

- `training`: RUNNING's step loop and FINISHING's and STOPPING's final checkpoint and export (`StepLoop`).
- `recording`: a finished step's row, events and gauges (`StepRecorder`; it keeps each rank's memory peak).
- `recovery`: RECOVERING's and RESIZING's one recovery-and-resize sequence (`Recovery`).
- `replica_drop`: local_sgd, diloco: a failed replica dropped from the round, the others going on (`ReplicaDrop`).
- `rejoin`: the end of both: every rank set up again with the job's state (`Rejoin`).
- `requests`: what the job was asked from outside that the actions read: a stop, and the fault drills.
"""
