"""The Tinker examples (examples/tinker_sl.py, examples/tinker_rl.py) run as written against the real service, on
the tiny model examples/tiny_model.py saves: the supervised loop's loss falls, the RL loop's mean reward rises (its
last rounds' mean above its first's). Slow (`make test-slow`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers import SLOW
from trainyard.service.tenancy import users

pytest.importorskip("tinker")
pytestmark = SLOW
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def examples():
    sys.path.insert(0, str(EXAMPLES))
    import tinker_rl
    import tinker_sl
    import tiny_model

    yield tiny_model, tinker_sl, tinker_rl
    sys.path.remove(str(EXAMPLES))


def test_the_supervised_and_rl_examples_learn(service, tmp_path, examples):
    tiny_model, tinker_sl, tinker_rl = examples
    service.manager.tinker.registered["examples-tiny"] = str(tiny_model.save_tiny_llama(tmp_path / "tiny"))
    key = "tml-" + users.create(service.state_dir, "tinker-examples")
    losses = tinker_sl.run(service.url, key, "examples-tiny", steps=12)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.25, losses
    means = tinker_rl.run(service.url, key, "examples-tiny", rounds=10)
    assert sum(means[-3:]) / 3 > sum(means[:3]) / 3 + 0.1, means
