"""Dispatching (spec §6.1–6.2, §6.7): arrivals in wall-clock time, a `--max-concurrency`
semaphore, dispatch indices, follow-ups, interrupts.

Loop: take the next request — the head of the pending follow-ups if its arrival is not later
than the next pre-generated one's (ties to the follow-up), else the pre-generated one; with
neither but sessions active, wait for a completion — sleep until S0 + arrival, take a slot
(head-of-line: later requests queue behind a blocked one and go out late, never skipped, never
re-timed), assign the next dispatch index and start the request.

Two departures from BLIS, both to honour arrivals: a completion during the sleep makes the
loop choose again (BLIS sleeps until the chosen request is due, so a follow-up due earlier
waits for it and goes out late), and an interrupt stops dispatching at once (BLIS may still
start a few overdue requests). Interrupted requests in flight are recorded as `error`
(context canceled) and the loop drains.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

from blis_jax.observe.client import Client, Outcome
from blis_jax.observe.http_request import RequestSpec
from blis_jax.observe.progress import Progress
from blis_jax.observe.prompts import PromptBuilder
from blis_jax.observe.sessions import LiveSessions, Planned
from blis_jax.observe.workload import ObservedWorkload


@dataclasses.dataclass
class Record:
    """One finished request: dispatch index, what was planned, what the client saw."""

    index: int
    planned: Planned
    outcome: Outcome


class Dispatcher:
    def __init__(self, workload: ObservedWorkload, client: Client, prompts: PromptBuilder,
                 sessions: LiveSessions, *, max_concurrency: int, warmup_requests: int = 0,
                 stream_all: bool = False, no_streaming: bool = False, progress: Progress | None = None) -> None:
        self.w, self.client, self.prompts, self.sessions = workload, client, prompts, sessions
        self.max_concurrency = max_concurrency
        self.warmup_requests = warmup_requests
        self.stream_all, self.no_streaming = stream_all, no_streaming
        self.progress = progress
        self.records: list[Record] = []       # completion order
        self.dispatched = 0
        self.max_in_flight = 0
        self._in_flight = 0
        self._cancelled = asyncio.Event()
        self._wake = asyncio.Event()
        self._pending: collections.deque[Planned] = collections.deque()
        self._active_sessions = 0
        self._tasks: set[asyncio.Task] = set()
        self.start_monotonic = 0.0

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def interrupt(self) -> None:
        """SIGINT/SIGTERM: stop dispatching, abort what is in flight."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            self.client.interrupt()

    def offset_us(self) -> int:
        return int((time.monotonic() - self.start_monotonic) * 1e6)

    async def run(self) -> list[Record]:
        sem = asyncio.Semaphore(self.max_concurrency)
        static = iter(self.w.static_rows.tolist())
        head: Planned | None = None
        self.start_monotonic = time.monotonic()
        while not self.cancelled:
            if head is None:
                row = next(static, None)
                head = None if row is None else self.sessions.planned_static(row)
            from_pending = bool(self._pending) and (head is None or self._pending[0].arrival_us <= head.arrival_us)
            if not from_pending and head is None:
                if self._active_sessions == 0:
                    break
                self._wake.clear()
                await self._wait_any(self._wake.wait())
                continue
            planned = self._pending[0] if from_pending else head
            delay = self.start_monotonic + planned.arrival_us / 1e6 - time.monotonic()
            if delay > 0:
                self._wake.clear()
                woke = await self._sleep(delay)
                if woke == "cancel":
                    break
                if woke == "wake":  # a follow-up (maybe due earlier) or a session end: choose again
                    continue
            if from_pending:
                self._pending.popleft()
            else:
                head = None
                if self.sessions.is_session(planned):
                    self._active_sessions += 1
            if self.stream_all:  # --record-itl (BLIS) or --stream
                planned.streaming = True
            if sem.locked():
                if not await self._wait_any(sem.acquire()):
                    break
            else:
                await sem.acquire()
            if self.cancelled:
                sem.release()
                break
            index = self.dispatched
            self.dispatched += 1
            task = asyncio.create_task(self._run_one(planned, index, sem))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        while self._tasks:  # drain
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        return self.records

    async def _sleep(self, delay: float) -> str:
        """Sleep `delay` s: "time" when it ran out, "wake" when a completion came first,
        "cancel" on an interrupt."""
        waits = [asyncio.ensure_future(self._cancelled.wait()), asyncio.ensure_future(self._wake.wait())]
        done, pending = await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if self._cancelled.is_set():
            return "cancel"
        return "wake" if done else "time"

    async def _wait_any(self, awaitable) -> bool:
        """Await `awaitable` unless an interrupt comes first (then cancel it; False)."""
        task = asyncio.ensure_future(awaitable)
        stop = asyncio.ensure_future(self._cancelled.wait())
        done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            stop.cancel()
            return True
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return False

    def _check_finish(self, spec: RequestSpec, out) -> None:
        """BLIS's diagnostics on the server's finish reason (stderr only; the row is unchanged)."""
        forced = 0 if self.client.config.unconstrained else spec.output_len  # min_tokens sent
        if out.finish_reason == "length" and forced <= 0:
            self.client.warn('finish_reason="length" (output may be truncated)')
        elif out.finish_reason == "abort":
            self.client.warn('finish_reason="abort" (server aborted request; timing data unreliable)')
        elif out.finish_reason == "stop" and 0 < out.output_tokens < forced:
            self.client.warn(f"generated {out.output_tokens} tokens (< min_tokens={forced}); "
                             "server may not support min_tokens")

    async def _run_one(self, planned: Planned, index: int, sem: asyncio.Semaphore) -> None:
        self._in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            r = self.w.requests
            row = planned.row
            group = ""
            if not planned.follow_up and r.prefix_group[row] >= 0:
                group = r.prefix_group_names[r.prefix_group[row]]
            prompt = self.prompts.build(planned.token_ids, int(r.input_len[row]), group)
            spec = RequestSpec(prompt=prompt, output_len=int(r.output_len[row]),
                               stream=planned.streaming and not self.no_streaming,
                               slo_class=str(r.slo_class[row]), tenant_id=str(r.tenant_id[row]),
                               slo_target_us=self.w.slo_target_us(row))
            if self.progress:
                self.progress.on_sent()
            outcome = await self.client.send(spec)
            completion = self.offset_us()
            self._check_finish(spec, outcome)
            if self.progress:
                self.progress.on_done(outcome.status == "ok")
            if index >= self.warmup_requests:
                self.records.append(Record(index, planned, outcome))
            if self.sessions.is_session(planned):
                nxt = None
                if not self.cancelled:
                    nxt = self.sessions.next_round(planned, outcome.status == "ok", outcome.output_tokens, completion)
                if nxt is None:
                    self._active_sessions -= 1
                else:
                    self._pending.append(nxt)
                self._wake.set()
        finally:
            self._in_flight -= 1
            sem.release()
