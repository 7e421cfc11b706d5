"""The measured costs `parallel: auto` plans with, as the service holds them: cached per node type in the state
directory (`parallel.plan.planner.calibration`), and measured (`parallel.runtime.calibrate`) in the background on first
use, one measurement at a time. A request never waits for a measurement (a minute of tiny training runs on 2 cores):
until the costs are there, a plan of `parallel: auto` is answered 503 with a Retry-After (`service.errors.Calibrating`),
and a submitted job waits in the queue for them (`service.admission.admit` plans it once they are known)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainyard.parallel.plan.admission import ClusterResources
from trainyard.service.errors import Calibrating

log = logging.getLogger("trainyard.calibration")

RETRY_AFTER_S = 30


class Calibrations:
    def __init__(self, state_dir: Path, measure: Callable[[Path, ClusterResources], object] | None = None):
        """`measure(state_dir, cluster)` measures and caches the node type's costs (`calibrate.machine_costs`)."""
        self.state_dir = Path(state_dir)
        self._measure = measure
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._started = 0.0
        self._failed: str | None = None

    def costs(self, cluster: ClusterResources):
        """The node type's `MachineCosts`; raises Calibrating (having started the measurement if none runs)."""
        from trainyard.parallel.plan.planner.calibration import cached_costs, node_type

        known = cached_costs(self.state_dir, cluster)
        if known is not None:
            return known
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                before, self._failed = self._failed, None
                self._started = time.time()
                self._thread = threading.Thread(target=self._run, args=(cluster,), name="trainyard-calibration",
                                                daemon=True)
                self._thread.start()
            else:
                before = None
            running_s = time.time() - self._started
        again = f" (the last measurement failed: {before})" if before else ""
        raise Calibrating(f"parallel: auto plans with this node type's measured costs ({node_type(cluster)}), "
                          f"which are being measured now, for {running_s:.0f} s so far (short training runs on "
                          f"tiny models, about a minute on 2 cores){again}; retry in {RETRY_AFTER_S} s",
                          RETRY_AFTER_S)

    def _run(self, cluster: ClusterResources) -> None:
        measure = self._measure
        if measure is None:  # imported here: torch-free until a measurement runs
            from trainyard.parallel.runtime.calibrate import machine_costs

            measure = machine_costs
        began = time.time()
        try:
            measure(self.state_dir, cluster)
            log.info("calibration of this node type done in %.0f s", time.time() - began)
        except Exception as e:  # noqa: BLE001 - told to the next request, which starts another
            self._failed = f"{type(e).__name__}: {e}"
            log.exception("calibration failed")
