"""`/api/plans`: a spec's plan (rank map, stage layers, memory, simulated schedule) against the cluster; creates
nothing."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Depends
from trainyard.api.body import JsonBodyRoute
from trainyard.api.deps import CALIBRATING, GUARDED, Manager, caller, read_spec
from trainyard.api.spec import RawSpec
from trainyard.parallel.plan.present import describe
from trainyard.service.tenancy.users import User

router = APIRouter(route_class=JsonBodyRoute, tags=["plans"])


@router.post("/api/plans", dependencies=GUARDED, responses=CALIBRATING)
def plan(manager: Manager, spec: Annotated[RawSpec, Body()], user: User = Depends(caller)) -> dict:
    """Validate a spec and return its plan with the resources it needs vs the cluster's; creates nothing."""
    spec, ranking = manager.choose_layout(manager.tenancy.for_user(read_spec(manager, spec, user), user))
    described = describe(manager.plan(spec))
    if ranking is not None:
        described["planner"] = ranking
    cluster = manager.cluster()
    described["resources"]["available"] = {"CPU": cluster.cpus, "GPU": cluster.gpus,
                                           "nodes": len(cluster.nodes)}
    return described
