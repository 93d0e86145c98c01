"""ASGI middlewares that answer before the app does any work: the API key(s), and the request-body size limit.

Both are plain ASGI (not Starlette's BaseHTTPMiddleware, which would put every streamed response through an
extra task and queue).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Sequence

from fastapi.responses import JSONResponse

from gyrfalcon.server.protocol import OpenAIError

# Paths anyone may read, API key or not (probes and scrapers carry no key).
PUBLIC_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})

# An oversized body that is still arriving is read and dropped, up to this many bytes, before the 413 goes out
# (nginx's "lingering close" does the same): HTTP/1.1 clients (httpx, the openai SDK, requests) write the whole
# body before they read the response, and a server that closes its socket with unread data makes the kernel
# send a reset, which over a real network can reach the client before it has read the 413. Past this limit, or
# when the client waits for `100 Continue` (curl does for large bodies), the 413 goes out at once.
_DRAIN_LIMIT_BYTES = 256 << 20


def _header(scope, name: bytes):
    for k, v in scope.get("headers", ()):
        if k == name:
            return v
    return None


def route_path(scope) -> str:
    """The path the routes see: without the --root-path prefix when the request carries it (a proxy that does not
    strip it), as Starlette's router matches."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


class APIKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` with one of `api_keys` (vLLM's --api-key takes several: one per
    client or a rotation's old and new key); compares digests in constant time, and every key's, so the time taken
    does not tell which key came close."""

    def __init__(self, app, api_keys: Sequence[str]) -> None:
        self.app = app
        self._expected = [hashlib.sha256(f"Bearer {k}".encode()).digest() for k in api_keys]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or route_path(scope) in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        got = hashlib.sha256(_header(scope, b"authorization") or b"").digest()
        ok = False
        for want in self._expected:
            ok |= hmac.compare_digest(got, want)
        if not ok:
            err = OpenAIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                              code="invalid_api_key")
            return await JSONResponse(err.body(), status_code=401)(scope, receive, send)
        return await self.app(scope, receive, send)


class RequestSizeLimitMiddleware:
    """HTTP 413 with an OpenAI error body for a request body past `max_bytes`, before any of it is parsed.

    A declared Content-Length is checked first; a body sent without one (chunked) is counted as it arrives.
    The body is collected here (the JSON routes read all of it before they start anyway) and handed to the
    app as one message; the connection's later messages (a client's disconnect) pass through as they come.
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.max_bytes <= 0:
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(scope, receive, send, int(declared), received=0, more=True)
        chunks, total, first = [], 0, None
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                first = message
                break
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                return await self._reject(scope, receive, send, None, total, message.get("more_body", False))
            chunks.append(body)
            if not message.get("more_body", False):
                break
        pending = [first or {"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            return pending.pop() if pending else await receive()

        return await self.app(scope, replay, send)

    async def _reject(self, scope, receive, send, declared, received: int, more: bool) -> None:
        size = f"{declared} bytes" if declared is not None else f"at least {received} bytes"
        err = OpenAIError(413, f"The request body is {size}, over this server's limit of {self.max_bytes} bytes "
                               "(--max-request-bytes).", type="invalid_request_error", code="request_too_large")
        expects_continue = (_header(scope, b"expect") or b"").lower() == b"100-continue"
        # Drop (not keep) the rest of the body so that the client gets to read the answer; see _DRAIN_LIMIT_BYTES.
        if more and not expects_continue and (declared or 0) <= _DRAIN_LIMIT_BYTES:
            while received <= _DRAIN_LIMIT_BYTES:
                message = await receive()
                if message["type"] != "http.request":
                    return
                received += len(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        await JSONResponse(err.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)
