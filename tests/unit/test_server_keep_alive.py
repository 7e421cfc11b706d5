"""`trainyard serve`'s HTTP server keeps an idle connection open longer than the CLI's client (httpx) keeps one:
the client always drops it first, so no request is sent on a connection the server is closing. At equal limits
(uvicorn's and httpx's defaults, 5 s each) the soak saw 3 of 1,000 requests fail with "Connection reset by
peer" while the service was up."""

import httpx
from trainyard.service.server import http_config


def test_the_server_keeps_an_idle_connection_longer_than_the_client():
    config = http_config(app=None, host="127.0.0.1", port=8000)
    client_idle_s = httpx.Client()._transport._pool._keepalive_expiry  # what cli.client.Client gets
    assert client_idle_s is not None and config.timeout_keep_alive > client_idle_s
