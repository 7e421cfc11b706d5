"""The client side: the `trainyard` command line (`main`: the command table; `offline`: commands that need no
server; `jobs`: commands over the API), the HTTP client (`client`), `make demo` (`demo`) and metrics plots
(`plot`). It talks to the service over HTTP only, except `serve`, which starts it (wiring `api.app` into
`service.server`), and `plan`/`prepare`, which run `parallel/`'s pure parts locally.
"""
