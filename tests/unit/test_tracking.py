"""Experiment tracking (`actors.tracking`): the trackers a spec asks for get one value per step, in step order,
each step once (a recovery's replayed steps and a restarted coordinator's known ones are not logged twice), and
the spec; what each wrote is read back with the library's own reader. A tracker missing here is a RuleError."""

from __future__ import annotations

import pytest
from helpers import tiny_spec
from trainyard.actors import tracking
from trainyard.actors.tracking import Trackers, missing_extra
from trainyard.parallel.spec import parse_spec


def _row(step: int) -> dict:
    return {"step": step, "loss": 1.0 / (step + 1), "lr": 0.1, "grad_norm": 2.0, "tokens_per_s": 100.0,
            "step_time_s": 0.5, "val_loss": 3.0 if step == 2 else None}


def test_each_tracker_gets_each_step_once_and_the_spec(tmp_path):
    config = parse_spec(tiny_spec(steps=4, tracking={"tensorboard": True, "wandb": {"mode": "offline"},
                                                     "mlflow": {"experiment": "exp"}}))
    trackers = Trackers("job1", config, tmp_path)
    for step in (0, 1, 2, 1, 2, 3):  # steps 1 and 2 run again after a recovery: logged once
        trackers.add(_row(step))
    trackers.close("SUCCEEDED")

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(tracking.locations(config, tmp_path)["tensorboard"])
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(s, pytest.approx(1 / (s + 1))) for s in range(4)]
    assert [e.step for e in events.Scalars("val_loss")] == [2]
    assert '"steps": 4' in events.Tensors("spec/text_summary")[0].tensor_proto.string_val[0].decode()

    runs = list((tmp_path / "wandb").glob("offline-run-*-job1"))
    assert len(runs) == 1 and (runs[0] / "run-job1.wandb").stat().st_size > 0

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking.locations(config, tmp_path)["mlflow"])
    (run,) = client.search_runs([client.get_experiment_by_name("exp").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["steps"] == "4"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == \
        [(s, pytest.approx(1 / (s + 1))) for s in range(4)]


def test_a_restarted_coordinator_goes_on_after_the_logged_steps(tmp_path):
    config = parse_spec(tiny_spec(steps=4, tracking={"tensorboard": True}))
    Trackers("job2", config, tmp_path).add(_row(0))  # the first coordinator logged step 0, then died unclosed
    again = Trackers("job2", config, tmp_path, last_logged=0)
    for step in (0, 1):
        again.add(_row(step))
    again.close("FAILED")
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    steps = []
    for run in (tmp_path / "tensorboard").glob("events.*"):
        mux = EventMultiplexer({"r": str(run)})
        mux.Reload()
        steps += [e.step for e in mux.Scalars("r", "loss")]
    assert sorted(steps) == [0, 1]


def test_a_tracker_that_is_not_installed_is_a_rule_error(monkeypatch):
    config = parse_spec(tiny_spec(steps=1, tracking={"wandb": {}}))
    assert missing_extra(config) is None
    monkeypatch.setitem(tracking.LIBRARIES, "wandb", "wandb_not_installed_here")
    error = missing_extra(config)
    assert error is not None and error.field == "tracking.wandb" and "trainyard[track]" in error.message
    assert missing_extra(parse_spec(tiny_spec(steps=1))) is None
