"""The servers' HTTP protocol refuses a request head past its size bound (431) and a head or body that stalls
(408), and nothing else: a real uvicorn on a real socket, with the protocol class the gateway and the engine
server run."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest

uvicorn = pytest.importorskip("uvicorn")

from kvfleet_common.server_kit.http_protocol import bounded_read_protocol  # noqa: E402

LIMIT = 16 * 1024
READ_TIMEOUT = 1.0


async def _echo_sizes(scope, receive, send) -> None:
    """Answers with the sizes of the head and the body it got."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    head = sum(len(k) + len(v) for k, v in scope["headers"])
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": json.dumps({"head": head, "body": len(body)}).encode()})


@pytest.fixture(scope="module")
def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            _echo_sizes,
            host="127.0.0.1",
            port=free,
            http=bounded_read_protocol(LIMIT, READ_TIMEOUT),
            log_level="error",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield free
    server.should_exit = True
    thread.join(10)


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def _exchange(port: int, *requests: bytes) -> bytes:
    """Send the requests on one connection (closing it after the last) and read everything until EOF."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for request in requests:
            try:
                sock.sendall(request)
            except (BrokenPipeError, ConnectionResetError):  # refused mid-send: the answer is still there
                break
        return _read_all(sock)


def _request(header_value: bytes = b"x", body: bytes = b"", close: bool = True) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: t\r\nx-request-id: %s\r\ncontent-length: %d\r\n%s\r\n%s"
        % (header_value, len(body), b"connection: close\r\n" if close else b"", body)
    )


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def test_a_head_past_the_bound_gets_a_431_and_the_connection_closes(port):
    response = _exchange(port, _request(b"a" * (LIMIT + 1), close=False), _request())
    assert _status(response) == 431
    error = json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "request_header_fields_too_large" and str(LIMIT) in error["message"]
    assert response.count(b"HTTP/1.1") == 1  # nothing after it was served on that connection


def test_a_huge_head_is_refused_without_reading_it_whole(port):
    """A 20 MB header: refused once the bound is passed, not after 20 MB were held."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nhost: t\r\nx-big: ")
        sent = 0
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            while sent < 20 << 20:
                sock.sendall(b"a" * 65536)
                sent += 65536
        assert sent < 4 << 20  # the server closed long before


def test_heads_within_the_bound_and_big_bodies_pass(port):
    big_body = b"b" * (LIMIT * 8)  # arrives in the same reads as its head: never counted as head
    response = _exchange(port, _request(b"a" * (LIMIT - 500), close=False), _request(body=big_body))
    statuses = [int(line.split(b" ")[1]) for line in response.split(b"\r\n") if line.startswith(b"HTTP/1.1")]
    assert statuses == [200, 200]
    answers = [json.loads(m) for m in re.findall(rb'\{"head": \d+, "body": \d+\}', response)]
    assert answers[0]["head"] > LIMIT - 1000 and answers[1]["body"] == len(big_body)


@pytest.mark.parametrize("sent_first", [b"", b"POST /v1/completions HTTP/1.1\r\nhost: t\r\nx-a"])
def test_a_head_that_does_not_arrive_in_time_gets_a_408(port, sent_first):
    """A silent connection, or half a head and then nothing (slowloris): answered and closed, not held."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(sent_first)
        started = time.monotonic()
        response = _read_all(sock)
        waited = time.monotonic() - started
    assert _status(response) == 408, response
    assert json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert waited < 5  # the server's 1 s, not the client's 10 s


def test_a_slow_head_within_the_timeout_and_a_long_keep_alive_pause_pass(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        request = _request(close=False)
        sock.sendall(request[:20])
        time.sleep(READ_TIMEOUT / 4)
        sock.sendall(request[20:])
        first = sock.recv(65536)
        time.sleep(READ_TIMEOUT * 2)  # idle between requests: uvicorn's keep-alive timeout (5 s), not ours
        sock.sendall(_request())
        rest = _read_all(sock)
    assert _status(first) == 200 and _status(rest) == 200


def test_a_body_that_stops_arriving_gets_a_408_and_one_that_keeps_coming_passes(port):
    head = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-length: 30\r\nconnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + b"x" * 10)  # a third of it, then nothing: the app waits in receive()
        started = time.monotonic()
        response = _read_all(sock)
        assert time.monotonic() - started < 5
    assert _status(response) == 408 and b"body did not arrive" in response
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head)
        for _ in range(3):  # longer than the timeout in all, never silent for as long
            time.sleep(READ_TIMEOUT * 0.5)
            sock.sendall(b"y" * 10)
        response = _read_all(sock)
    assert _status(response) == 200 and b'"body": 30' in response
