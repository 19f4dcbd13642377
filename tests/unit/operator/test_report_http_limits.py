"""The step-report server bounds slow and oversized clients (issue 32, defect 7), on a real
socket on 127.0.0.1 (the server as the operator starts it: :func:`start_site`):

* a connection that sends half a request's headers is closed within the header timeout (as
  is one that never starts its TLS handshake);
* a chunked body over the size limit gets 413 and the connection is then closed, not kept for
  another request; a body that stalls gets 408 and is closed too.

Bounds are short here (1 s), every wait is bounded, and the whole file runs in a few seconds.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from operator_fakekube import FakeKube
from test_reports import NS, add_job, run

from rlpacer.api.protocol import steps_path
from rlpacer.operator import tls
from rlpacer.operator.metrics import Metrics
from rlpacer.operator.runtime import Jobs
from rlpacer.operator.server import MAX_REPORT_BYTES, LeaderState, report_app, start_site
from rlpacer.operator.settings import OperatorSettings

pytestmark = pytest.mark.unit

HEADER_S = 1.0  # the header timeout under test
BODY_S = 1.0  # the body timeout under test
SLACK_S = 1.5  # scheduling slack on a loaded 2-core machine
GIVE_UP_S = 6.0  # how long a test waits for a close the server owes it (the default is 1 h)


@dataclass
class Server:
    port: int
    token: str
    jobs: Jobs


@asynccontextmanager
async def serving(ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[Server]:
    fk = FakeKube()
    add_job(fk, "job")
    cfg = OperatorSettings(leader_election=False, resync_seconds=3600,
                           http_header_timeout_seconds=HEADER_S,
                           report_body_timeout_seconds=BODY_S)
    jobs = Jobs(fk, cfg, Metrics())  # type: ignore[arg-type]
    rt = await jobs.get(NS, "job")
    assert rt is not None
    await jobs.reconcile(rt)  # the token Secret
    tok = await jobs.token(rt)
    assert tok
    runner, port = await start_site(report_app(jobs, LeaderState(True), Metrics()),
                                    "127.0.0.1", 0, ssl_context,
                                    header_timeout=cfg.http_header_timeout_seconds)
    try:
        yield Server(port, tok, jobs)
    finally:
        await runner.cleanup()


async def closed_after(reader: asyncio.StreamReader, t0: float) -> tuple[float, bytes]:
    """Seconds from ``t0`` until the server closed the connection (EOF or reset), and what it
    sent before; fails after :data:`GIVE_UP_S`."""
    got = b""
    try:
        async with asyncio.timeout(GIVE_UP_S):
            while chunk := await reader.read(65536):
                got += chunk
    except TimeoutError:
        raise AssertionError(f"still open after {GIVE_UP_S} s; received {got[:200]!r}") from None
    except ConnectionResetError:
        pass
    return time.monotonic() - t0, got


def test_half_sent_headers_are_closed_within_the_header_timeout() -> None:
    async def body() -> None:
        async with serving() as srv:
            # half of a request line and headers, then nothing (as a slow-loris client does)
            t0 = time.monotonic()
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(f"POST {steps_path(NS, 'job')} HTTP/1.1\r\nHost: x\r\nAuthori".encode())
            await writer.drain()
            waited, got = await closed_after(reader, t0)
            assert HEADER_S - 0.2 <= waited <= HEADER_S + SLACK_S, waited
            assert got == b"", got  # no answer to a request that never came
            writer.close()
            # a connection that sends nothing at all is closed the same way
            t0 = time.monotonic()
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            waited, _ = await closed_after(reader, t0)
            assert waited <= HEADER_S + SLACK_S, waited
            writer.close()
            # ... while one that sends its request in time is answered as before
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            async with asyncio.timeout(GIVE_UP_S):
                line = await reader.readline()
            assert line.startswith(b"HTTP/1.1 404"), line  # JSON 404 of this app
            writer.close()

    run(body)


def test_a_silent_client_is_closed_within_the_timeout_before_its_tls_handshake(
        tmp_path: Path) -> None:
    certs = tls.generate(tmp_path, ["127.0.0.1"], days=1)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certs / "tls.crt", certs / "tls.key")

    async def body() -> None:
        async with serving(ctx) as srv:
            t0 = time.monotonic()
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)  # no TLS
            waited, _ = await closed_after(reader, t0)
            assert waited <= HEADER_S + SLACK_S, waited
            writer.close()

    run(body)


def _chunked_head(path: str, token: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()


def test_an_oversized_chunked_body_gets_413_and_the_connection_is_closed() -> None:
    async def body() -> None:
        async with serving() as srv:
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(_chunked_head(steps_path(NS, "job"), srv.token))
            chunk = b"x" * 8192
            for _ in range(MAX_REPORT_BYTES // len(chunk) + 2):  # past the limit, then done
                writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            t0 = time.monotonic()
            waited, got = await closed_after(reader, t0)
            head, _, rest = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 413"), got[:300]
            assert b"Connection: close" in head, head
            assert json.loads(rest)["reason"] == "TooLarge", rest
            assert waited <= SLACK_S, waited  # closed once answered, no keep-alive
            writer.close()

            # a client that stops mid-body after the limit: answered, then closed shortly
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(_chunked_head(steps_path(NS, "job"), srv.token))
            for _ in range(MAX_REPORT_BYTES // len(chunk) + 2):
                writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            await writer.drain()
            t0 = time.monotonic()
            waited, got = await closed_after(reader, t0)
            assert got.startswith(b"HTTP/1.1 413"), got[:300]
            assert waited <= 1.0 + SLACK_S, waited  # LINGER_SECONDS, then closed
            writer.close()

    run(body)


def test_a_stalled_body_gets_408_and_the_connection_is_closed() -> None:
    async def body() -> None:
        async with serving() as srv:
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write((f"POST {steps_path(NS, 'job')} HTTP/1.1\r\nHost: x\r\n"
                          f"Authorization: Bearer {srv.token}\r\n"
                          "Content-Type: application/json\r\nContent-Length: 400\r\n\r\n"
                          '{"attempt": 0, ').encode())
            await writer.drain()
            t0 = time.monotonic()
            waited, got = await closed_after(reader, t0)
            head, _, rest = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), got[:300]
            assert json.loads(rest)["reason"] == "RequestTimeout", rest
            assert BODY_S - 0.2 <= waited <= BODY_S + 1.0 + SLACK_S, waited
            writer.close()

    run(body)
