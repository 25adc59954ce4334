"""Which client ``X-Request-Id`` the servers carry on (``kvfleet_common.server_kit.http.client_request_id``)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from starlette.requests import Request

from kvfleet_common.server_kit.http import MAX_REQUEST_ID_CHARS, client_request_id


def _request(value: bytes | None) -> Request:
    headers = [] if value is None else [(b"x-request-id", value)]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers})


@pytest.mark.parametrize("value", [
    b"req-1", b"0af7651916cd43dd8448eb211c80319c", b"a/b+c=d_e.f:g@h~i", b"x" * MAX_REQUEST_ID_CHARS,
])  # fmt: skip
def test_a_usable_id_is_kept_as_sent(value):
    assert client_request_id(_request(value)) == value.decode()


@pytest.mark.parametrize("value", [
    None, b"", b"x" * (MAX_REQUEST_ID_CHARS + 1), b"x" * 8192, b"two words", b"tab\there", b"caf\xc3\xa9",
    b"bell\x07", b"del\x7f",
])  # fmt: skip
def test_anything_else_is_not_taken(value):
    assert client_request_id(_request(value)) is None
