"""The CLI against a fake OpenAI server in its own thread (the CLI runs its own event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from tests.unit.loadtest.fake_openai import FakeOpenAI, start_fake_openai


@contextlib.contextmanager
def fake_openai_in_thread(**options):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = FakeOpenAI(**options)
    runner, url = asyncio.run_coroutine_threadsafe(start_fake_openai(server), loop).result(timeout=10)
    try:
        yield server, url
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
