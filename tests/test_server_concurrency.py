"""Clients that leave free their slot; concurrent streams give what one-at-a-time gives."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import httpx
import openai
from server_util import wait_until

NO_EOS = {"2": -100}
LONG = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 200,
        "logit_bias": NO_EOS}


def running(url: str) -> int:
    return httpx.get(url + "/stats").json()["running"]


def test_stream_dropped_after_three_chunks_frees_the_slot(server_url: str) -> None:
    with httpx.stream("POST", server_url + "/v1/chat/completions",
                      json={**LONG, "stream": True}, timeout=30) as resp:
        assert resp.status_code == 200
        lines = (line for line in resp.iter_lines() if line)
        chunks = [json.loads(next(lines)[len("data: "):]) for _ in range(3)]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert running(server_url) == 1
    # leaving the block closed the connection mid-stream
    assert wait_until(lambda: running(server_url) == 0, timeout=1.0)
    stats = httpx.get(server_url + "/stats").json()
    assert stats["requests_finished"].get("cancelled", 0) >= 1


def test_non_streaming_client_gone_frees_the_slot(server_url: str, tiny_engine: Any) -> None:
    cancelled = lambda: tiny_engine.stats()["requests_finished"].get("cancelled", 0)
    before = cancelled()
    body = json.dumps(LONG).encode()
    host, port = server_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_until(lambda: running(server_url) == 1, timeout=5.0)
    # the socket is closed while the answer is being generated
    assert wait_until(lambda: cancelled() > before, timeout=1.0)
    assert wait_until(lambda: running(server_url) == 0, timeout=1.0)


def test_eight_concurrent_streams_equal_one_at_a_time(server_url: str) -> None:
    topics = ["cats", "the sea", "Paris", "tokenizers", "rain", "chess", "bread", "stars"]
    requests = [{"model": "", "messages": [{"role": "user", "content": f"Write about {t}."}],
                 "max_tokens": 16, "temperature": 0, "logit_bias": NO_EOS} for t in topics]
    sync = openai.OpenAI(base_url=server_url + "/v1", api_key="x", max_retries=0)
    one_at_a_time = [sync.chat.completions.create(**r).choices[0].message.content
                     for r in requests]

    async def stream_one(client: openai.AsyncOpenAI, req: dict[str, Any]) -> tuple[str, str]:
        parts, finish = [], ""
        async for chunk in await client.chat.completions.create(**req, stream=True):
            for ch in chunk.choices:
                parts.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
        return "".join(parts), finish

    async def all_at_once() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=server_url + "/v1", api_key="x",
                                      max_retries=0) as client:
            return await asyncio.gather(*(stream_one(client, r) for r in requests))

    results = asyncio.run(all_at_once())
    assert [finish for _, finish in results] == ["length"] * 8
    assert [text for text, _ in results] == one_at_a_time
    assert running(server_url) == 0
