"""The stand-in's `_sync_api` decorator, shared by engine.py and engine_lora.py (stand-in only)."""
from __future__ import annotations

import functools


def _sync_api(method):
    """Every synchronous method of the real Engine ends in `self.loop.run_until_complete(...)` on
    the loop the Engine took when it was built (note 1.1); the stand-in runs its body the same way,
    so a call inside a running loop fails as SGLang's does: "This event loop is already running"
    when the Engine holds the running loop, "Cannot run the event loop while another loop is
    running" when it holds another one."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        async def body():
            return method(self, *args, **kwargs)

        coro = body()
        try:
            return self.loop.run_until_complete(coro)
        finally:
            coro.close()  # never started when the loop refused to run: no "never awaited" warning

    return call
