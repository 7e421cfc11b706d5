"""`/api/cluster` (what the cluster holds) and `/healthz` (no token needed)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from trainyard.api.body import JsonBodyRoute
from trainyard.api.deps import GUARDED, Manager
from trainyard.api.models import ClusterInfo

router = APIRouter(route_class=JsonBodyRoute, tags=["cluster"])


@router.get("/healthz")
def healthz() -> dict:
    return {"ok": True}


@router.get("/api/cluster", dependencies=GUARDED)
def cluster(manager: Manager, request: Request) -> ClusterInfo:
    c = manager.cluster()
    return ClusterInfo(nodes=len(c.nodes), cpus=c.cpus, gpus=c.gpus, ray_address=request.app.state.ray_address,
                       dashboard_url=manager.dashboard_url)
