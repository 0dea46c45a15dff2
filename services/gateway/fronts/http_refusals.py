"""How both HTTP fronts (OpenAI /v1, KServe REST /v2) answer a refusal: one middleware, each front's body.

The status code and Retry-After of a domain error come from one table (http_status.py); what
differs between the fronts is only the body's shape, which each passes in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web

from services.common import errors

log = logging.getLogger(__name__)


def refusal_middleware(domain: Callable[[errors.InfermeshError], web.Response],
                       plain: Callable[[int, str], web.Response]):
    """Domain errors through `domain`; aiohttp's own refusals (404 route, 405 method, 413 body too
    large) and bugs (500) through `plain(status, message)`."""

    @web.middleware
    async def refusals(request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = plain(exc.status, f"{request.method} {request.path}: {exc.reason}")
            if "Allow" in exc.headers:
                response.headers["Allow"] = exc.headers["Allow"]
            return response
        except errors.InfermeshError as err:
            return domain(err)
        except Exception:
            log.exception("unhandled error in %s %s", request.method, request.path)
            return plain(500, "internal error")

    return refusals
