"""The Tinker-compatible training API's service side: its sessions, training clients (live jobs of their own kind,
each a `ClientSession` actor holding its ranks) and futures (`clients.py`), and the JobConfig a client's
`create_model` becomes (`specs.py`)."""

from trainyard.service.tinker.clients import TinkerClients

__all__ = ["TinkerClients"]
