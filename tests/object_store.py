"""A real S3 server for the tests: moto's server mode on a free port of 127.0.0.1.

``s3`` (a fixture) starts one :class:`moto.server.ThreadedMotoServer` per test
session, and for each test sets ``AWS_ENDPOINT_URL`` and dummy credentials in
the environment (for that test only, through ``monkeypatch``) and makes a new
bucket; it yields an :class:`S3` with the bucket's URL and the environment a
worker process needs (workers come from a forkserver started before the test,
so they set it themselves: :func:`use`).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import pytest

# Dummy credentials: moto accepts any; never real ones in tests.
_ENV = {
    "AWS_ACCESS_KEY_ID": "testing-key-id",
    "AWS_SECRET_ACCESS_KEY": "testing-secret-never-shown",
    "AWS_SESSION_TOKEN": "testing-token",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@attrs.frozen(kw_only=True)
class S3:
    """One test's bucket on the session's server."""

    url: str  # s3://BUCKET
    env: Mapping[str, str]
    server: Any = attrs.field(repr=False)

    def fs(self) -> Any:
        """A fresh s3fs filesystem on the server (not fsspec's cached instance)."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True)


def use(env: Mapping[str, str]) -> None:
    """In a worker process: point s3fs at the test's server."""
    os.environ.update(env)


@pytest.fixture(scope="session", name="moto_server")
def moto_server_fixture() -> Iterator[tuple[Any, str]]:
    pytest.importorskip("s3fs")
    server_module = pytest.importorskip("moto.server")
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield server, f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture(name="s3")
def s3_fixture(moto_server: tuple[Any, str], monkeypatch: pytest.MonkeyPatch) -> S3:
    """A new bucket on a local S3 server; the environment points s3fs at it for this test."""
    server, endpoint = moto_server
    env = {**_ENV, "AWS_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL_S3": endpoint}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    import fsspec
    import s3fs

    fsspec.filesystem("s3").clear_instance_cache()
    bucket = f"faccel-{secrets.token_hex(6)}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    return S3(url=f"s3://{bucket}", env=env, server=server)
