"""How the SGLang adapter calls its Engine: on which thread, with Ctrl-C held, outcomes shared.

Event loops. SGLang's synchronous Engine methods run `self.loop.run_until_complete(...)` on
the loop the Engine took when it was built: 0.5.21's `Engine._ensure_event_loop` takes the
running loop if there is one, else this thread's loop (a new one on a thread that has none);
0.5.17 takes the running loop, else a new one. A Jupyter cell runs inside the kernel's
running loop, so an Engine built there holds that loop, and its first call fails with
"This event loop is already running"; an Engine built outside a loop and called inside one
fails with "Cannot run the event loop while another loop is running" (asyncio's
`_check_running`). `EngineThread` therefore builds the Engine on, and makes every call
from, one dedicated thread as soon as the calling thread runs a loop: that thread runs none,
so the Engine gets and keeps a loop of its own. Off a running loop (scripts, torchrun)
nothing changes. Built on that thread, SGLang installs no SIGQUIT handler (signal handlers
are for the main thread only): a scheduler failure then ends this process through SIGQUIT's
default action instead of SGLang's process-tree kill; the kernel dies either way. A new
thread's current CUDA device is cuda:0 whatever the caller's is, so the engine thread sets the
engine's device first (the Engine's own CUDA work, the adapter's memory reads there).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional


def loop_running() -> bool:
    """Whether an asyncio event loop runs in this thread (a notebook cell, an `asyncio.run`)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class EngineThread:
    """Runs Engine construction and calls inline, or on one dedicated thread once a loop runs here."""

    def __init__(self, device: Any = None) -> None:
        """device: the engine's torch.device; a CUDA one becomes the current device of the engine thread."""
        self._pool: Optional[ThreadPoolExecutor] = None
        self._device = device

    @property
    def dedicated(self) -> bool:
        return self._pool is not None

    def run(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """fn(*args, **kwargs) here, or on the engine's thread (where it stays once it is used:
        the Engine's loop was made, or last ran, there)."""
        if self._pool is None and loop_running():
            setup: dict[str, Any] = {}
            if getattr(self._device, "type", None) == "cuda":
                import torch

                setup = {"initializer": torch.cuda.set_device, "initargs": (self._device,)}
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-engine", **setup)
        if self._pool is None:
            return fn(*args, **kwargs)
        return self._pool.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        """Let the thread go (Engine.shutdown needs no loop, so it runs wherever it is called)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


@contextlib.contextmanager
def scoped_env(updates: dict[str, str]):
    """Environment variables set to `updates` inside the block (for processes started there), then put back."""
    before = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def attempt(fn, *args, **kwargs) -> tuple[str, Any]:
    """("ok", fn(...)) or ("error", what it raised): an outcome the owner sends to its group,
    so that a failure reaches every rank instead of leaving them in a collective."""
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as err:  # noqa: BLE001 - the other ranks must hear about it
        return "error", f"{type(err).__name__}: {err}"


def unwrap(outcome: tuple[str, Any], what: str) -> Any:
    """The value of an `attempt` outcome, or its error raised on this rank."""
    status, value = outcome
    if status == "error":
        raise RuntimeError(f"SGLang {what} failed: {value}")
    return value


def uninterrupted(method):
    """Ctrl-C (SIGINT) waits until the engine call returns, then takes effect.

    SGLang finishes a call it has started whatever happens in this process, and a call on an engine
    that is still in the middle of one kills it (a release while requests decode fails the scheduler's
    idle assertion: SIGQUIT to this process, sglang-api.md 0.1); a call cut off between SGLang's answer
    and this side's bookkeeping leaves the two disagreeing about what is resident. So the interrupt is
    held, with a warning, and delivered when the call is done; a second Ctrl-C interrupts at once.
    Off the main thread (no signal handlers there) the call runs as it is."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return method(self, *args, **kwargs)
        held: list[int] = []

        def hold(signum, frame):
            if held:
                raise KeyboardInterrupt
            held.append(signum)
            warnings.warn(
                f"interrupt held until SGLang's {method.__name__} returns (cutting it off leaves SGLang "
                "in a state the next call crashes on); press Ctrl-C again to interrupt anyway"
            )

        previous = signal.signal(signal.SIGINT, hold)
        try:
            result = method(self, *args, **kwargs)
        finally:
            signal.signal(signal.SIGINT, previous)
        if held:  # delivered as the handler in place would have: StopSignal's graceful stop, or KeyboardInterrupt
            if callable(previous):
                previous(held[0], None)
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt
        return result

    return call
