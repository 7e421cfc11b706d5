"""The bearer token check: any token but the right one is a 401, whatever its characters."""

import pytest
from fastapi.testclient import TestClient
from trainyard.api.app import create_app


@pytest.mark.parametrize("header, status", [
    (b"Bearer secret", 200),
    (b"Bearer secreT", 401),
    (b"Bearer ", 401),
    ("Bearer sécret".encode(), 401),  # compare_digest raised TypeError on non-ASCII: a 500
    ("Bearer \u00e9".encode("latin-1"), 401),
])
def test_a_wrong_token_is_401_whatever_its_characters(header, status):
    class Manager:
        dashboard_url = None

        def cluster(self):
            from trainyard.parallel.plan import ClusterResources

            return ClusterResources(nodes=())

    client = TestClient(create_app(manager=Manager(), token="secret"), raise_server_exceptions=False)
    response = client.get("/api/cluster", headers={"Authorization": header})
    assert response.status_code == status, response.text
