"""Users: tokens stored hashed and found in constant time, the token commands, and the API's 401 for a token
that is not (or no longer) a user's."""

from __future__ import annotations

import json
import stat

import pytest
from fastapi.testclient import TestClient
from trainyard.api.app import create_app
from trainyard.cli.main import main
from trainyard.service.tenancy import users


def test_a_token_is_kept_only_as_its_sha256_and_found_by_it(tmp_path):
    token = users.create(tmp_path, "alice", max_cpus=2)
    stored = (tmp_path / users.USERS_FILE).read_text()
    assert token not in stored and users.hash_token(token) in stored
    assert stat.S_IMODE((tmp_path / users.USERS_FILE).stat().st_mode) == 0o600
    assert users.hash_token("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # FIPS 180-2
    found = users.find(users.read(tmp_path), token)
    assert found is not None and found.name == "alice" and found.quota == users.Quota(cpus=2.0)
    assert users.find(users.read(tmp_path), token[:-1]) is None and users.find([], token) is None


@pytest.mark.parametrize("name, words", [("admin", "state directory's token"), ("", "1 to 64 letters"),
                                         ("a b", "1 to 64 letters"), ("-x", "starting with a letter"),
                                         ("x" * 65, "1 to 64")])
def test_a_bad_user_name_is_refused_and_nothing_is_written(tmp_path, name, words):
    with pytest.raises(users.UserError, match=words):
        users.create(tmp_path, name)
    assert users.read(tmp_path) == []


def test_the_token_commands_create_list_and_revoke(tmp_path, capsys):
    state = ["--state-dir", str(tmp_path)]
    assert main([*state, "token", "create", "alice", "--max-cpus", "4", "--max-gpus", "1"]) == 0
    token = capsys.readouterr().out.strip()
    assert len(token) >= 40 and main([*state, "token", "create", "root2", "--admin"]) == 0
    assert main([*state, "token", "create", "alice"]) == 2 and "exists" in capsys.readouterr().err
    assert main([*state, "token", "create", "bob", "--max-cpus", "0"]) == 2
    assert "--max-cpus must be a positive number" in capsys.readouterr().err
    assert main([*state, "token", "list"]) == 0
    listed = capsys.readouterr().out
    assert "alice  user " in listed and "root2  admin" in listed and token not in listed
    assert main([*state, "token", "revoke", "alice"]) == 0 and main([*state, "token", "revoke", "alice"]) == 2
    assert [u["name"] for u in json.loads((tmp_path / users.USERS_FILE).read_text())["users"]] == ["root2"]


def test_a_users_token_is_accepted_until_revoked_without_a_restart(tmp_path):
    class Manager:
        dashboard_url = None

        def cluster(self):
            from trainyard.parallel.plan import ClusterResources

            return ClusterResources(nodes=())

    app = create_app(Manager(), "admin-token", users=users.Registry(tmp_path))
    client = TestClient(app, raise_server_exceptions=False)

    def status(token: str) -> int:
        return client.get("/api/cluster", headers={"Authorization": f"Bearer {token}"}).status_code

    assert status("admin-token") == 200 and status("not-yet") == 401
    token = users.create(tmp_path, "alice")
    assert status(token) == 200
    users.revoke(tmp_path, "alice")
    assert status(token) == 401 and status("admin-token") == 200
