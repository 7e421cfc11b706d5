"""The Coordinator actor's `stop` without Ray: the actor's own class, around a scripted controller."""

import asyncio

from trainyard.actors.coordinator import Coordinator


class ScriptedController:
    """Runs until asked to stop, as the controller's driver loop does at a step boundary."""

    def __init__(self) -> None:
        self.stopping = asyncio.Event()
        self.ran = self.stopped = False

    async def run(self) -> None:
        self.ran = True
        await self.stopping.wait()
        self.stopped = True

    def request_stop(self, suspend: bool) -> None:
        self.stopping.set()

    def report(self, since: int) -> dict:
        return {"status": "STOPPED" if self.stopped else "RECOVERING"}


def test_a_restarted_coordinator_asked_to_stop_before_any_poll_recovers_and_stops():
    """Ray restarts a coordinator whose process died; its run starts on the service's next poll. A stop that came
    first returned at once without stopping anything: the service then killed it and the job ended STOPPED with no
    model, at a step no checkpoint held."""
    coordinator = Coordinator.__ray_metadata__.modified_class.__new__(Coordinator.__ray_metadata__.modified_class)
    coordinator.restarted, coordinator._task = True, None

    async def stop() -> dict:
        coordinator.controller = ScriptedController()
        return await coordinator.stop(grace_s=5)

    assert asyncio.run(stop()) == {"status": "STOPPED"}
    assert coordinator.controller.ran and coordinator.controller.stopped
