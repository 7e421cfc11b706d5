"""The schedule room: pipeline schedules in their action vocabulary (`actions`: what a rank does, and the rules of
the vocabulary), the registry of schedule kinds and the action lists each makes (`schedules`: `SCHEDULES`), and
their simulator (`schedule_sim`: the checks every schedule must pass; `schedule_timing`: a run under given costs,
its bubble and peak activations). Pure: no torch."""
