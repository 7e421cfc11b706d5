"""The pipeline schedule kinds, one module each (`SCHEDULE`, a `parallel.plan.schedule.kind.Schedule`):
`gpipe`, `one_f_one_b`, `interleaved`, `zb_h1`, `zbv`, `two_bw`. A new kind is a module here, its line in
`parallel.plan.schedule.schedules.SCHEDULES` and its name in `parallel.names.ScheduleKind`."""
