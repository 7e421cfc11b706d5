"""A small HTTP client of the trainyard API, used by the CLI, the demo and the benchmarks."""

from __future__ import annotations

import json
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

import httpx


class ApiError(RuntimeError):
    """An API error, phrased as the API phrased it."""

    def __init__(self, status_code: int, message: str):
        super().__init__(message)
        self.status_code = status_code


def _spec_body(spec: dict) -> dict:
    """A spec as a request body. httpx's `json=` refuses NaN and infinities (a YAML `.nan`, `.inf`) with a
    ValueError; sent as JSON's NaN/Infinity, the API answers a 422 naming the field that may not hold one."""
    return {"content": json.dumps(spec), "headers": {"content-type": "application/json"}}


def _job(job_id: str) -> str:
    """The job's path, its id as one path segment. Put in as it was, an id holding '/', '?', '#' or a '..'
    segment named another path: `stop JOB/../OTHER` stopped OTHER, and `status ''` printed the job list."""
    if not job_id:
        raise ApiError(0, "a job id cannot be empty")
    return "/api/jobs/" + quote(job_id, safe="").replace(".", "%2E")  # '.' too: '..' is a segment's parent


def _chunks(f: IO[bytes], size: int = 1 << 20) -> Iterator[bytes]:
    while chunk := f.read(size):
        yield chunk


class Client:
    def __init__(self, url: str, token: str | None, timeout_s: float = 120.0):
        if token and not token.isascii():  # httpx raised UnicodeEncodeError: a traceback, not an error line
            raise ApiError(0, "the token has a non-ASCII character, which the Authorization header cannot carry "
                              "(the service's token is in the state directory's `token` file)")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            self._http = httpx.Client(base_url=url, headers=headers, timeout=timeout_s)
        except httpx.InvalidURL as e:
            raise ApiError(0, f"{url!r} is not a URL of the trainyard API ({e})") from None

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as e:
            raise ApiError(0, f"cannot reach the trainyard API at {self._http.base_url} ({e}); "
                              "is `trainyard serve` running?") from None
        if response.status_code >= 400:
            raise ApiError(response.status_code, _error_text(response))
        return response.json() if response.content else None

    def healthz(self) -> bool:
        return bool(self._call("GET", "/healthz")["ok"])

    def submit(self, spec: dict) -> str:
        return self._call("POST", "/api/jobs", **_spec_body(spec))["job_id"]

    def plan(self, spec: dict) -> dict:
        return self._call("POST", "/api/plans", **_spec_body(spec))

    def upload(self, path: Path, name: str | None = None) -> dict:
        """Upload a file, or a directory (sent as a tar, made in a temporary file), streamed from disk; the answer
        holds the `path` a spec names."""
        name = name or path.resolve().name
        if not path.is_dir():
            with open(path, "rb") as f:
                return self._call("POST", "/api/files", params={"name": name}, content=_chunks(f),
                                  headers={"content-type": "application/octet-stream"})
        with tempfile.TemporaryFile() as tmp:
            with tarfile.open(fileobj=tmp, mode="w") as tar:
                for item in sorted(path.rglob("*")):
                    if item.is_symlink():
                        raise ApiError(0, f"{item} is a link; an uploaded directory holds plain files and folders")
                    tar.add(item, arcname=str(item.relative_to(path)), recursive=False)
            tmp.seek(0)
            return self._call("POST", "/api/files", params={"name": name, "archive": "tar"}, content=_chunks(tmp),
                              headers={"content-type": "application/octet-stream"})

    def uploads(self) -> list[dict]:
        return self._call("GET", "/api/files")

    def delete_upload(self, upload_id: str) -> None:
        self._call("DELETE", "/api/files/" + quote(upload_id, safe="").replace(".", "%2E"))

    def jobs(self) -> list[dict]:
        return self._call("GET", "/api/jobs")

    def job(self, job_id: str) -> dict:
        return self._call("GET", _job(job_id))

    def metrics(self, job_id: str, since: int = 0) -> list[dict]:
        return self._call("GET", f"{_job(job_id)}/metrics", params={"since": since})

    def logs(self, job_id: str, rank: int | None = None, tail: int = 1000, since: int | None = None,
             stream: str = "stderr") -> dict:
        params = {"tail": tail, "stream": stream, "rank": rank, "since": since}
        params = {key: value for key, value in params.items() if value is not None}
        return self._call("GET", f"{_job(job_id)}/logs", params=params)

    def download_model(self, job_id: str, path: Path, format: str = "trainyard") -> Path:  # noqa: A002
        """Stream the job's trained model (safetensors; a tar of an HF directory with format="hf") to `path`
        (written whole, then renamed)."""
        tmp = path.with_name(path.name + ".part")
        try:
            with self._http.stream("GET", f"{_job(job_id)}/model", params={"format": format}) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ApiError(response.status_code, _error_text(response))
                with tmp.open("wb") as f:
                    for chunk in response.iter_bytes(1 << 20):
                        f.write(chunk)
        except httpx.TransportError as e:
            raise ApiError(0, f"cannot reach the trainyard API at {self._http.base_url} ({e})") from None
        tmp.replace(path)
        return path

    def tracking(self, job_id: str) -> dict[str, str]:
        return self._call("GET", f"{_job(job_id)}/tracking")

    def events(self, job_id: str) -> list[dict]:
        return self._call("GET", f"{_job(job_id)}/events")

    def scale(self, job_id: str, dp: int) -> dict:
        return self._call("POST", f"{_job(job_id)}/scale", json={"dp": dp})

    def stop(self, job_id: str) -> dict:
        return self._call("POST", f"{_job(job_id)}/stop")

    def delete(self, job_id: str) -> None:
        self._call("DELETE", _job(job_id))

    def cluster(self) -> dict:
        return self._call("GET", "/api/cluster")


def _error_text(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except ValueError:
        return f"HTTP {response.status_code}: {response.text}"
    if isinstance(detail, list):
        return "\n".join(f"{d.get('field') or '.'.join(map(str, d.get('loc', [])))}: {d.get('msg')}" for d in detail)
    return f"HTTP {response.status_code}: {detail}"
