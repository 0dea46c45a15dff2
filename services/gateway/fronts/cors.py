"""CORS for the HTTP port (--http-cors-origins): browser pages of the listed origins may call the APIs.

Off unless origins are configured, as in Envoy and Triton (vLLM allows every origin by default). A browser
sends a preflight (OPTIONS with Origin and Access-Control-Request-Method) before a POST with a JSON body or
an Authorization header: a listed origin gets 204 with the methods and the headers it asked for; any other
gets 403 without CORS headers, so its page sees the call fail. Every other response to a listed origin
carries Access-Control-Allow-Origin and exposes the headers clients read (request id, timings, retry hint).
No credentials mode: callers bring API keys in Authorization, not cookies, so "*" may stand for any origin.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiohttp import web

ANY_ORIGIN = "*"
ALLOWED_METHODS = "GET, POST, HEAD, OPTIONS"
# Response headers a page's script may read (the browser hides all but a few otherwise).
EXPOSED_HEADERS = "x-request-id, x-infermesh-timings, server-timing, retry-after"
PREFLIGHT_MAX_AGE_S = 600


class Cors:
    def __init__(self, origins: Sequence[str]) -> None:
        self._any = ANY_ORIGIN in origins
        self._origins = frozenset(o.rstrip("/") for o in origins if o != ANY_ORIGIN)

    def allowed(self, origin: str | None) -> str | None:
        """What Access-Control-Allow-Origin says to `origin`; None when it may not call."""
        if not origin:
            return None
        if self._any:
            return ANY_ORIGIN
        return origin if origin in self._origins else None

    @web.middleware
    async def preflight(self, request: web.Request, handler) -> web.StreamResponse:
        """Answers a preflight itself (no route has OPTIONS); everything else goes on to the fronts."""
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        allowed = self.allowed(request.headers.get("Origin"))
        if allowed is None:
            return web.Response(status=403, text="CORS: this origin may not call this server\n")
        headers = {
            "Access-Control-Allow-Origin": allowed,
            "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
            "Vary": "Origin",
        }
        asked = request.headers.get("Access-Control-Request-Headers")
        if asked:
            headers["Access-Control-Allow-Headers"] = asked
        return web.Response(status=204, headers=headers)

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Before any response's headers go out (streams included): the allow headers for a listed origin."""
        allowed = self.allowed(request.headers.get("Origin"))
        if allowed is None or "Access-Control-Allow-Origin" in response.headers:
            return
        response.headers["Access-Control-Allow-Origin"] = allowed
        response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS
        if allowed != ANY_ORIGIN:
            response.headers.add("Vary", "Origin")
