"""The Tinker-compatible training API's service side: its sessions, training clients (live jobs of their own kind,
each a `ClientSession` actor holding its ranks) and futures (`clients.py`), the JobConfig a client's
`create_model` becomes (`specs.py`), and their saved state: checkpoints, training runs (`state.py`)."""

from trainyard.service.tinker.clients import TinkerClients

__all__ = ["TinkerClients"]
