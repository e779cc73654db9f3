"""The event loop that runs async reward functions (``async def f(prompts, completions, **columns)``, as TRL's).

One asyncio loop on a daemon thread of its own, for the life of the process: the caller may already run a loop in
its thread (a notebook), where ``asyncio.run`` refuses, and a function may keep loop-bound objects (an
``httpx.AsyncClient``, a semaphore) from one call to the next. A process forked after the loop started (a
DataLoader worker, a forked rank) gets its own: the thread does not survive a fork.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Sequence
from typing import Any

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid: int | None = None


def event_loop() -> asyncio.AbstractEventLoop:
    """This process's reward loop, started on first use."""
    global _loop, _loop_pid
    with _lock:
        if _loop is None or _loop_pid != os.getpid() or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="lit_grpo-async-rewards", daemon=True).start()
            _loop, _loop_pid = loop, os.getpid()
        return _loop


def run_concurrently(awaitables: Sequence[Awaitable[Any]]) -> list[Any]:
    """Each awaitable's result, or the exception it raised, in order; all run at once on ``event_loop()``."""
    async def gather() -> list[Any]:
        return await asyncio.gather(*awaitables, return_exceptions=True)

    return asyncio.run_coroutine_threadsafe(gather(), event_loop()).result()
