"""`parallel: auto` never makes a request wait for the node type's calibration (a minute of training runs on
tiny models here): the first request starts it in the background and is told to come back (503, Retry-After),
as is every request while it runs, and none starts a second one; once cached, the costs are answered at once."""

from __future__ import annotations

import threading

import pytest
from helpers import tiny_spec, wait_for
from trainyard.parallel.plan.admission import ClusterResources, NodeResources
from trainyard.parallel.plan.planner.calibration import cached_costs, node_type, store_costs
from trainyard.parallel.plan.planner.machine_costs import default_gpu_costs
from trainyard.parallel.spec import parse_spec
from trainyard.service.calibration import Calibrations
from trainyard.service.errors import Calibrating

CLUSTER = ClusterResources(nodes=(NodeResources(cpus=8, gpus=0),))


def test_the_first_request_starts_the_measurement_and_none_waits_for_it(tmp_path):
    release, calls = threading.Event(), []

    def measure(state_dir, cluster):  # stands in for the minute-long `calibrate.machine_costs`, which it writes
        calls.append(cluster)
        assert release.wait(30)
        key = node_type(cluster)
        # as the product writes it (atomically): a plain write_text was once read half-written, by the wait below
        store_costs(state_dir, key, default_gpu_costs(key))

    calibrations = Calibrations(tmp_path, measure)
    for _ in range(3):
        with pytest.raises(Calibrating) as info:
            calibrations.costs(CLUSTER)
        assert info.value.retry_after_s > 0 and "being measured now" in str(info.value)
    assert len(calls) == 1  # one measurement, however many requests came meanwhile
    release.set()
    wait_for(lambda: cached_costs(tmp_path, CLUSTER) is not None, 30, "the calibration to be cached")
    assert calibrations.costs(CLUSTER) == cached_costs(tmp_path, CLUSTER)


def test_a_failed_measurement_is_told_and_the_next_request_starts_another(tmp_path):
    calls = []

    def measure(state_dir, cluster):
        calls.append(cluster)
        raise OSError("no room for the ranks")

    calibrations = Calibrations(tmp_path, measure)
    with pytest.raises(Calibrating):
        calibrations.costs(CLUSTER)
    wait_for(lambda: calibrations._thread is not None and not calibrations._thread.is_alive(), 30, "the failure")
    with pytest.raises(Calibrating) as info:
        calibrations.costs(CLUSTER)
    assert "the last measurement failed: OSError: no room for the ranks" in str(info.value) and len(calls) == 2


def test_the_api_answers_503_with_retry_after_while_calibrating(tmp_path):
    from fastapi.testclient import TestClient
    from trainyard.api.app import create_app

    class Tenancy:
        def confine(self, spec, user):
            return spec

        def for_user(self, config, user):
            return config

    class Manager:  # only what the plan route reaches before the planner
        tenancy = Tenancy()

        def choose_layout(self, config):
            raise Calibrating("being measured now", 30)

    client = TestClient(create_app(manager=Manager(), token="t"))
    spec = {**tiny_spec(), "parallel": "auto"}
    parse_spec(spec)  # a valid spec
    response = client.post("/api/plans", json=spec, headers={"Authorization": "Bearer t"})
    assert response.status_code == 503 and response.headers["Retry-After"] == "30"
    assert "being measured now" in response.json()["detail"]


def test_a_parallel_auto_spec_is_told_the_rules_no_layout_changes_while_the_costs_are_measured(tmp_path):
    """Seen: `parallel: auto` with seq_len above the model's context was queued (201) while the costs were measured
    and FAILED once planned; a fixed layout got the 422 at once. Now both do, before any layout or cost."""
    from trainyard.parallel.plan import PlanError
    from trainyard.service.manager import JobManager

    class Measuring:
        def costs(self, cluster):
            raise Calibrating("being measured now", 30)

    manager = JobManager.__new__(JobManager)  # choose_layout reads the calibrations only
    manager.calibrations = Measuring()
    bad = parse_spec({**tiny_spec(), "parallel": "auto", "model": {**tiny_spec()["model"], "seq_len": 64,
                                                                   "context_len": 1}})
    with pytest.raises(PlanError) as info:
        manager.choose_layout(bad)
    assert info.value.field == "model.seq_len" and "context_len=1" in info.value.message
