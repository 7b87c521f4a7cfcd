"""The server's listening socket: connections on it send each streamed chunk at once."""

from __future__ import annotations

import asyncio
import socket

import pytest

from ascend_vlm.serving.server import bind_socket


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        pytest.param(
            "::1", marks=pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback")
        ),
    ],
)
def test_connections_on_the_listener_turn_nagle_off(host):
    """A server-sent event written right after another must not wait for the client's delayed
    acknowledgement (up to 40 ms on Linux): asyncio sets TCP_NODELAY on what it accepts only
    when the socket names its protocol."""
    listener = bind_socket(host, 0)
    port = listener.getsockname()[1]
    seen: list[int] = []

    async def main() -> None:
        async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connection = writer.get_extra_info("socket")
            seen.append(connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=listener)
        async with server:
            _, writer = await asyncio.open_connection(host, port)
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(main())
    assert seen and seen[0] != 0
