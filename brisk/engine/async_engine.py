"""AsyncEngine: the LLMEngine's step loop in its own thread, fed and drained from asyncio.

    event loop (server handlers)                    engine thread
    ───────────────────────────                     ──────────────────────────────────────
    add() ── inbox (add / abort commands) ────────► drain inbox: add_request / abort_request
      ▲        └─ Future: accepted or ValueError     engine.step()
      │                                              each RequestOutput ─► call_soon_threadsafe
    asyncio.Queue per request ◄───────────────────── (the request's queue)

The engine is touched by its own thread only, so no lock is held across a step and a handler
never waits for one: the event loop stays free while the CPU computes. A step that raises ends
its requests with the error (the engine already gave their blocks back) and the loop goes on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from brisk.engine.llm_engine import LLMEngine
from brisk.engine.outputs import RequestOutput
from brisk.request import SamplingParams


class EngineOverloaded(Exception):
    """The waiting queue is full: the caller should retry later (HTTP 503 with Retry-After)."""


class EngineDead(Exception):
    """The engine thread stopped (shutdown or a fatal error)."""


class RequestAborted(Exception):
    """The request was aborted (its client went away) before it finished."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    sink: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop
    accepted: concurrent.futures.Future[None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 256) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: queue.Queue[_Add | str | None] = queue.Queue()  # str: an id to abort; None: stop
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="brisk-engine", daemon=True)
        self._stopped = threading.Event()
        self.fatal: BaseException | None = None
        self.stats: dict[str, float] = {}  # engine.stats(), published by the engine thread after each step

    # ---------------------------------------------------------------- caller side (event loop)
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped.is_set()

    async def add(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                  request_id: str | None = None) -> tuple[str, asyncio.Queue[RequestOutput | BaseException]]:
        """Queue a request; returns its id and the queue its outputs arrive on. ValueError for bad
        input (nothing queued), EngineOverloaded when the waiting line is full."""
        if not self.alive:
            raise EngineDead(f"the engine is not running{f': {self.fatal}' if self.fatal else ''}")
        waiting = int(self.stats.get("waiting", 0))
        if waiting + self._inbox.qsize() >= self.max_waiting:
            raise EngineOverloaded(f"{waiting} requests are already waiting (limit {self.max_waiting})")
        rid = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        sink: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        accepted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._inbox.put(_Add(rid, prompt_token_ids, params, prompt, sink, loop, accepted))
        if self._stopped.is_set():  # the thread ended between the check above and the put
            self._fail_inbox(EngineDead("the engine stopped"))
        try:
            await asyncio.wrap_future(accepted)  # raises the engine's ValueError, if any
        except asyncio.CancelledError:
            self.abort(rid)  # the caller gave up while the request was being admitted
            raise
        return rid, sink

    def abort(self, request_id: str) -> None:
        """Stop a request (a client went away); its KV blocks go back to the pool. Thread-safe."""
        self._inbox.put(request_id)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._inbox.put(None)
        self._thread.join(timeout)

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if not self._drain(block=not busy):
                    break
                if not busy:
                    self.engine.check()  # idle: a parallel worker that ended stops the engine now
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish()
        except BaseException as e:  # noqa: BLE001 - reported to every waiting caller, then the thread ends
            self.fatal = e
        finally:
            self._stopped.set()
            err = EngineDead(f"the engine stopped{f': {self.fatal}' if self.fatal else ''}")
            for rid in list(self._sinks):
                self._deliver(rid, err)
            self._fail_inbox(err)

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; wait for one when idle. False when asked to stop."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if item is None:
                return False
            if isinstance(item, str):
                if self.engine.abort_request(item):
                    self._deliver(item, RequestAborted(f"request {item} was aborted"))
            else:
                self._accept(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _accept(self, add: _Add) -> None:
        if not add.accepted.set_running_or_notify_cancel():
            return  # the caller was cancelled before admission: nothing to add
        try:
            self.engine.add_request(add.request_id, add.prompt_token_ids, add.params, prompt=add.prompt,
                                    arrival_time=time.perf_counter())
        except ValueError as e:
            add.accepted.set_exception(e)
            return
        self._sinks[add.request_id] = (add.loop, add.sink)
        add.accepted.set_result(None)

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the step's requests end with the error; others go on
            if getattr(e, "fatal", False):
                raise  # the engine cannot run any step (a parallel worker died): the loop ends, callers get 503
            listening = set(self._sinks)  # every request in flight has a sink until it ends
            gone = listening - set(self.engine.unfinished_request_ids())
            if not gone:
                # the failure was outside the forward (scheduling, bookkeeping): retrying would
                # fail the same way forever, so every request in flight ends with the error
                gone = listening
                for rid in listening:
                    self.engine.abort_request(rid)
            for rid in gone:
                self._deliver(rid, RuntimeError(f"generation failed: {e}"))
            return
        for out in outs:
            self._deliver(out.request_id, out)
        for rid, error in self.engine.take_failures().items():  # ended alone; the step's others went on
            self._deliver(rid, RuntimeError(f"generation failed: {error}"))

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        target = self._sinks.get(rid)
        if target is None:
            return
        if isinstance(item, BaseException) or item.finished:
            del self._sinks[rid]
        loop, sink = target
        try:
            loop.call_soon_threadsafe(sink.put_nowait, item)
        except RuntimeError:
            pass  # that event loop is closed: nobody is listening any more

    def _publish(self) -> None:
        self.stats = self.engine.stats()  # a new dict each time: readers on other threads see a whole one

    def _fail_inbox(self, err: BaseException) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Add) and not item.accepted.done():
                item.accepted.set_exception(err)

    def info(self) -> dict[str, Any]:
        return dict(self.stats)
