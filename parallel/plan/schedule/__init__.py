"""The schedule room: pipeline schedules in their action vocabulary (`actions`: what a rank does, and the rules of
the vocabulary), what a schedule kind is (`kind`: `Schedule`, its compute orders' `Compute`), the kinds themselves,
one module each (`kinds/`: gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv), their registry and the action lists they make
with the messages placed (`schedules`: `SCHEDULES`, `build_schedule`), and the simulator (`schedule_sim`: the checks
every schedule must pass; `schedule_timing`: a run under given costs, its bubble and peak activations). Pure: no
torch."""
