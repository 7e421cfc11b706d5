"""The planner room: `parallel: auto` chooses a layout (`planner.choose`) from the options a config leaves open
(`search_options`), searched best-first (`planner_search`) and ranked by predicted step time (`prediction`, over
the cost model `cost_model`), with the reasons for each ranking (`planner_explain`). The costs are a machine's,
measured once per node type and cached (`calibration`: the fits and the cache; `machine_costs`: what a measurement
holds, and the defaults for a GPU); the measuring run itself needs torch and lives in
`parallel.runtime.calibrate`. Pure: no torch."""
