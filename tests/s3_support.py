"""A real S3 endpoint for tests: moto in server mode on loopback (s3fs talks HTTP to it)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def moto_s3(monkeypatch: pytest.MonkeyPatch, bucket: str = "eaglescale-test") -> Iterator[dict]:
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    # Credentials come from the environment, as in production; never from storage_options.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    try:
        import boto3
        import httpx

        # moto's backends are process-global: start every test from an empty store.
        httpx.post(f"{endpoint}/moto-api/reset").raise_for_status()

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        yield {"endpoint": endpoint, "bucket": bucket, "storage_options": {"client_kwargs": {"endpoint_url": endpoint}}}
    finally:
        server.stop()
