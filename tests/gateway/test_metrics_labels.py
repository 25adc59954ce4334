"""``/metrics`` cannot be grown by a tenant: label values come from known models and tenants only.

A hostile tenant sent 2,000 distinct model names and twenty 1 MiB ones: each became a label value of the
request counter and duration histogram, and ``/metrics`` reached 404 MiB. Unknown names are now counted
under one label, and echoed and logged clipped.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx

from kvfleet_gateway.metrics import UNKNOWN_MODEL
from tests.gateway.gateway_harness import MODEL

JUNK = 10_000
HUGE = 20  # of them 1 MiB long


def _junk_requests(key: str) -> list[bytes]:
    """10,000 requests naming models nobody has (twenty of them 1 MiB names), as raw HTTP/1.1."""
    names = [f"junk-{i}-{'x' * (i % 50)}" for i in range(JUNK - HUGE)]
    names += [f"huge-{i}-" + "y" * (1 << 20) for i in range(HUGE)]
    out = []
    for i, name in enumerate(names):
        path, body = (
            ("/v1/completions", {"model": name, "prompt": "x"}) if i % 2
            else ("/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "x"}]})
        )  # fmt: skip
        raw = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nhost: gw\r\nauthorization: Bearer {key}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n")  # fmt: skip
        out.append(head.encode() + raw)
    return out


async def _pipelined(url: str, requests: list[bytes], connections: int = 4) -> list[tuple[int, bytes]]:
    """Send the requests over a few keep-alive connections, pipelined: the client costs next to nothing,
    so the test's time is the gateway's."""
    host, port = url.removeprefix("http://").split(":")

    async def one_connection(batch: list[bytes]) -> list[tuple[int, bytes]]:
        reader, writer = await asyncio.open_connection(host, int(port))

        async def write() -> None:
            for req in batch:
                writer.write(req)
                await writer.drain()

        async def read() -> list[tuple[int, bytes]]:
            answers = []
            for _ in batch:
                status = int((await reader.readline()).split()[1])
                length = 0
                while (line := await reader.readline()) != b"\r\n":
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                answers.append((status, await reader.readexactly(length)))
            return answers

        try:
            return (await asyncio.gather(write(), read()))[1]
        finally:
            writer.close()

    batches = await asyncio.gather(*(one_connection(requests[i::connections]) for i in range(connections)))
    return [answer for batch in batches for answer in batch]


def test_ten_thousand_junk_model_names_leave_metrics_under_a_megabyte(fleet):
    g = fleet.gateway
    key = g.create_tenant("name-sender")
    ok = httpx.post(f"{g.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
                    headers={"Authorization": f"Bearer {key}"}, timeout=60)  # fmt: skip
    assert ok.status_code == 200, ok.text

    answers = asyncio.run(_pipelined(g.url, _junk_requests(key)))
    assert len(answers) == JUNK and {status for status, _ in answers} == {404}
    huge = [json.loads(body)["error"] for _, body in answers if b"huge-" in body]
    assert len(huge) == HUGE  # the 1 MiB names: echoed clipped
    for err in huge:
        assert err["code"] == "model_not_found" and len(err["message"]) < 200, err
        assert re.search(r"\.\.\. \(104858\d characters\) does not exist$", err["message"]), err

    text = httpx.get(f"{g.url}/metrics", timeout=60).text
    assert len(text.encode()) < 1 << 20, len(text)
    assert "junk-" not in text and "huge-" not in text
    values = re.findall(r'model="([^"]*)"', text)
    assert set(values) <= {MODEL, UNKNOWN_MODEL}, sorted(set(values))[:10]
    assert g.metric("kvfleet_gateway_requests_total", model=UNKNOWN_MODEL, status="404") == JUNK
    assert g.metric("kvfleet_gateway_requests_total", model=MODEL, tenant="name-sender", status="200") == 1
    assert g.metric("kvfleet_gateway_rejected_requests_total", reason="unknown_model") == JUNK

    log = g.log()
    assert "y" * 100 not in log and max(map(len, log.splitlines())) < 2000
    assert re.search(r"\.\.\. \(104858\d characters\)", log)  # logged, clipped
    assert httpx.get(f"{g.url}/health", timeout=10).status_code == 200
