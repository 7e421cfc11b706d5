"""The embedded cluster's start beside another Ray on the same machine (`service.ray_runtime`), without starting
one: what `ray.init` would be given."""

from __future__ import annotations

import contextlib
import socket

from ray._private import parameter, ray_constants
from trainyard.service import ray_runtime

DEFAULT = ray_constants.DEFAULT_DASHBOARD_AGENT_LISTEN_PORT


def _agent_port() -> int | None:
    with ray_runtime.agent_port_clear_of_other_clusters():
        return parameter.RayParams().dashboard_agent_listen_port


def test_the_dashboard_agent_takes_any_free_port_when_another_ray_holds_the_default():
    """Before, a service started beside a test session's Ray (or a `ray start`) waited 3.4 s for its agent to give
    up on the taken port: three times in the service-restart test."""
    with socket.socket() as other_ray:
        with contextlib.suppress(OSError):  # held already (by the test session's Ray): as good
            other_ray.bind(("", DEFAULT))
            other_ray.listen()
        assert not ray_runtime._port_free(DEFAULT)
        assert _agent_port() is None  # Ray's node start binds port 0: any free one
    assert parameter.RayParams().dashboard_agent_listen_port == DEFAULT  # nothing patched outside the start


def test_a_free_default_port_is_kept(monkeypatch):
    monkeypatch.setattr(ray_runtime, "_port_free", lambda port: port == DEFAULT)
    assert _agent_port() == DEFAULT
