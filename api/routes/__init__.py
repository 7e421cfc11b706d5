"""The REST resources, one router each: a new resource is one module here and a line in `ROUTERS`."""

from trainyard.api.routes import cluster, files, jobs, plans, tinker, tinker_sampling, tinker_state

ROUTERS = [jobs.router, plans.router, cluster.router, files.router, tinker.router, tinker_sampling.router,
           tinker_state.router]
