"""Eager pure-Python discrete-event reference of BLIS's single-instance engine.

Test oracle only (never imported by ``blis_jax``). It reproduces, per request and per
step, what ``blis replay`` computes for a one-instance cluster (``sim/simulator.go``,
``sim/batch_formation.go``, ``sim/kv/cache.go``; spec: ``shared/spec/blis-features.md``
§2.1-§2.13, §3.1-§3.2); it matches all 16 single-instance blis-diff cases exactly.

The latency model is injected (``LatencyHooks``):

* ``step_time(batch) -> int``: µs of one step; ``batch`` is a list of
  ``(is_prefill, new_tokens, progress_index, input_len)`` of the requests with
  ``NumNewTokens > 0``, in running-batch order. It must already apply BLIS's
  ``max(1, trunc(.))`` (an empty batch must give 1).
* ``queueing_time(input_len) -> int``: arrival -> enqueue delay (α0 or α0 + α1·in).
* ``output_token_time`` (α2, added to TTFT and every ITL sample) and
  ``post_decode_time`` (α1 for trained-physics, 0 for roofline; added to E2E).

Requests are duck-typed objects with ``request_id, arrival_us, input_len, output_len,
deadline_us, prefix_group, prefix_len, priority`` (see ``tests/blis_diff.TraceRequest``),
given in injection order (ties keep this order).

Output (``SimResult``): per request ``status, ttft_us, e2e_us, itl, sched_delay_us,
output_tokens, num_preemptions``; counters; and a per-step log (``StepRecord``: start,
step time, ``(request_id, new_tokens, progress_before)`` of every request in the running
batch after batch formation -- including ones given 0 tokens -- plus admitted / preempted /
completed ids).

Token content is synthetic: a full prompt block lying completely inside the group prefix
is identified by ``("g", group, block_index)`` (shared by the group), every other block by
``("r", request_id, offset, block_index)`` (unique to the request, stable across
preemptions because BLIS's token content is fixed per request). For hit/miss purposes this
is equivalent to BLIS's SHA-256 hash chain.

Non-obvious BLIS behaviour reproduced here (each one is needed by some blis-diff case):

* A request admitted with a fully cached prompt (prompt a multiple of 16 tokens, every
  block still cached -- only a preempted request re-admitted can hit this) gets
  NumNewTokens = 0 and BLIS's ``AllocateKVBlocks(start == end)`` succeeds **without
  claiming the cached blocks**: no hits counted, no refcount, the request holds no KV
  blocks; it is not in the step-time batch, reaches PI = input (TTFT) at the end of that
  step and then decodes into freshly popped blocks (B01, E03).
* Completion at PI >= input + max(out, 1) - 1 first allocates the final token's slot (a
  fresh block, counted as a miss, when the last block is full), then releases (B01, E03).
* Release appends a request's blocks to the free-list tail in reverse order; allocation pops
  the head; freed blocks keep their hash until popped (B01, E03).
* Phase 2 admission stops for the rest of a step once any preemption happened (B01, E03).
* Completion/timeout: a request is completed at its last step's *start*; a timeout falling
  inside that step is lazily cancelled and does not advance the clock (A03).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# instance event priorities (blis-features.md §2.1)
EV_ARRIVAL, EV_QUEUED, EV_STEP, EV_LEFT, EV_TIMEOUT = 0, 1, 3, 5, 6

QUEUED, RUNNING, COMPLETED, TIMED_OUT, DROPPED, ARRIVING, LENGTH_CAPPED = (
    "queued", "running", "completed", "timed_out", "dropped", "arriving", "length_capped")


@dataclass
class EngineConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    total_kv_blocks: int = 1_000_000
    block_size: int = 16
    max_model_len: int = 0            # 0 = unlimited
    scheduler: str = "fcfs"           # fcfs | priority-fcfs | sjf | reverse-priority
    preemption_policy: str = "fcfs"   # fcfs | priority
    horizon_us: int = 2**62


@dataclass
class LatencyHooks:
    step_time: Callable[[list], int]
    queueing_time: Callable[[int], int]
    output_token_time: int
    post_decode_time: int


# ----------------------------------------------------------------------------- KV cache
class KVCache:
    """Single-tier block pool with prefix caching (blis-features.md §2.9)."""

    def __init__(self, total_blocks: int, block_size: int):
        self.n = total_blocks
        self.bs = block_size
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(total_blocks))  # head first
        self.ref = [0] * total_blocks
        self.fill = [0] * total_blocks          # tokens held by the block
        self.hash: list = [None] * total_blocks
        self.by_hash: dict = {}
        self.req_blocks: dict[int, list[int]] = {}
        self.req_offset: dict[int, int] = {}    # token position of the request's first block
        self.hits = 0
        self.misses = 0

    @staticmethod
    def block_key(req, j: int, bs: int, offset: int = 0):
        """Content identity of the request's j-th block when its block list starts at token
        ``offset`` (0 except after a zero-token admission, see ``allocate``)."""
        if offset == 0 and req.prefix_group and (j + 1) * bs <= req.prefix_len:
            return ("g", req.prefix_group, j)
        return ("r", req.request_id, offset, j)

    def used_blocks(self) -> int:
        return self.n - len(self.free)

    def cached_blocks(self, req) -> list[int]:
        """Longest prefix of the prompt's full blocks present in the hash map (pure query)."""
        out = []
        for j in range(req.input_len // self.bs):
            b = self.by_hash.get(self.block_key(req, j, self.bs))
            if b is None:
                break
            out.append(b)
        return out

    def _forget(self, b: int) -> None:
        """Drop the map entry of block b's key as b is reused (only if it still maps to b)."""
        old = self.hash[b]
        if old is not None and self.by_hash.get(old) == b:
            del self.by_hash[old]

    def _register(self, req, j: int, b: int):
        h = self.block_key(req, j, self.bs, self.req_offset[req.request_id])
        self.hash[b] = h
        self.by_hash[h] = b

    def _claim(self, blocks: list, claim) -> None:
        """Take the cached blocks `claim` for a request (each a hit), appending them to `blocks`."""
        for b in claim:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
            self.hits += 1
            blocks.append(b)

    def allocate(self, req, start: int, end: int, cached: Sequence[int] = ()) -> bool:
        """Check-then-act allocation of token slots [start, end) (plus claim of ``cached``)."""
        bs = self.bs
        ntok = end - start
        if ntok == 1 and not cached:                      # fast path: one decode token
            blocks = self.req_blocks.get(req.request_id)
            if blocks:
                last = blocks[-1]
                if self.fill[last] < bs:
                    self.fill[last] += 1
                    if self.fill[last] == bs:
                        self._register(req, len(blocks) - 1, last)
                    return True
        if ntok <= 0:
            # BLIS quirk: a zero-token allocation (fully cached prompt admitted with
            # NumNewTokens = 0) succeeds without claiming the cached blocks: no hits, no
            # refcount; the request runs on without its prompt blocks.
            return True
        blocks = self.req_blocks.get(req.request_id)
        spare = 0
        if blocks:
            last = blocks[-1]
            spare = bs - self.fill[last]
        claim = list(cached) if not blocks else []
        need = -(-max(ntok - spare, 0) // bs) + sum(1 for b in claim if self.ref[b] == 0)
        if need > len(self.free):
            return False
        if blocks is None:
            blocks = self.req_blocks[req.request_id] = []
            self.req_offset[req.request_id] = start - len(claim) * bs
        self._claim(blocks, claim)
        rem = ntok
        if blocks and spare > 0 and rem > 0:
            last = blocks[-1]
            take = min(spare, rem)
            self.fill[last] += take
            rem -= take
            if self.fill[last] == bs:
                self._register(req, len(blocks) - 1, last)
        while rem > 0:
            b = self.free.popitem(last=False)[0]
            self._forget(b)
            self.hash[b] = None
            take = min(bs, rem)
            self.ref[b] = 1
            self.fill[b] = take
            self.misses += 1
            blocks.append(b)
            rem -= take
            if take == bs:
                self._register(req, len(blocks) - 1, b)
        return True

    def release(self, req):
        blocks = self.req_blocks.pop(req.request_id, None)
        self.req_offset.pop(req.request_id, None)
        if not blocks:
            return
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None


# ----------------------------------------------------------------------------- requests
@dataclass(eq=False)
class _Req:
    src: object
    request_id: int
    arrival: int
    input_len: int
    output_len: int
    deadline: int
    prefix_group: str
    prefix_len: int
    priority: int
    sort_id: str
    state: str = ARRIVING
    pi: int = 0                    # ProgressIndex
    computed: int = 0
    num_new: int = 0
    ttft: int | None = None        # FirstTokenTime relative to arrival
    itl: list = field(default_factory=list)
    sched_delay: int | None = None
    e2e: int | None = None
    output_tokens: int = 0
    num_preemptions: int = 0


@dataclass
class StepRecord:
    start_us: int
    step_time_us: int
    batch: list            # (request_id, new_tokens, progress_before) of every running request
    admitted: list         # request ids newly admitted this step
    preempted: list        # request ids preempted this step (in preemption order)
    completed: list        # request ids completing at the end of this step


@dataclass
class SimResult:
    requests: dict         # request_id -> {status, ttft_us, e2e_us, itl, sched_delay_us, ...}
    counters: dict
    steps: list            # list[StepRecord]


# ----------------------------------------------------------------------------- engine
class ReferenceEngine:
    def __init__(self, requests, cfg: EngineConfig, lat: LatencyHooks, record_steps: bool = True):
        self.cfg = cfg
        self.lat = lat
        self.record_steps = record_steps
        self.reqs = [
            _Req(src=r, request_id=int(r.request_id), arrival=int(r.arrival_us),
                 input_len=int(r.input_len), output_len=int(r.output_len),
                 deadline=int(r.deadline_us), prefix_group=r.prefix_group or "",
                 prefix_len=int(r.prefix_len) if r.prefix_group else 0,
                 priority=int(r.priority), sort_id=f"request_{int(r.request_id)}")
            for r in requests
        ]
        self.kv = KVCache(cfg.total_kv_blocks, cfg.block_size)
        self.heap: list = []
        self.seq = 0
        self.wait: list[_Req] = []
        self.running: list[_Req] = []
        self.step_pending = False
        self.clock = 0
        self.steps: list[StepRecord] = []
        self.c = dict.fromkeys(
            ("preemption_count", "dropped_unservable", "timed_out", "length_capped",
             "total_input_tokens", "completed", "total_output_tokens", "step_count"), 0)

    # -- events
    def _push(self, t, prio, kind, data=None):
        heapq.heappush(self.heap, (t, prio, self.seq, kind, data))
        self.seq += 1

    def _schedule_step(self, t):
        self.step_pending = True
        self._push(t, EV_STEP, "step")

    def run(self) -> SimResult:
        # cluster arrival -> admission -> routing are all at t and run before instance
        # events of the same tick, so pushing the instance arrivals up front is equivalent
        for r in self.reqs:
            self._push(r.arrival, EV_ARRIVAL, "arrival", r)
        horizon = self.cfg.horizon_us
        while self.heap:
            t, _prio, _, kind, r = self.heap[0]
            if t > horizon:
                break
            heapq.heappop(self.heap)
            if kind == "timeout" and r.state in (COMPLETED, TIMED_OUT, LENGTH_CAPPED):
                continue                           # lazy cancellation: clock not advanced
            self.clock = t
            if kind == "arrival":
                self._push(t + int(self.lat.queueing_time(r.input_len)), EV_QUEUED, "queued", r)
            elif kind == "queued":
                self._enqueue(r, t)
                if not self.step_pending and self.wait:
                    self._schedule_step(t)
            elif kind == "step":
                self._step(t)
            elif kind == "left":
                pass
            elif kind == "timeout":
                self._timeout(r, t)
        return self._finalize()

    # -- enqueue (§2.3)
    def _enqueue(self, r: _Req, now: int):
        cfg = self.cfg
        mml = cfg.max_model_len
        budget = r.output_len
        if budget == 0 and mml > 0 and r.input_len < mml:
            budget = mml - r.input_len
        if (budget < 0
                or (mml > 0 and (r.input_len >= mml or (budget > 0 and r.input_len + budget > mml)))
                or -(-r.input_len // cfg.block_size) > cfg.total_kv_blocks):
            r.state = DROPPED
            self.c["dropped_unservable"] += 1
            return
        self.c["total_input_tokens"] += r.input_len
        if 0 < r.deadline <= now:
            r.state = TIMED_OUT
            self.c["timed_out"] += 1
            return
        r.state = QUEUED
        self.wait.append(r)
        if 0 < r.deadline <= cfg.horizon_us:
            self._push(r.deadline, EV_TIMEOUT, "timeout", r)

    # -- timeout (§2.13)
    def _timeout(self, r: _Req, now: int):
        if r.state in (DROPPED, ARRIVING):
            return
        prev = r.state
        r.state = TIMED_OUT
        self.c["timed_out"] += 1
        self.kv.release(r)
        if prev == RUNNING:
            self.running = [x for x in self.running if x is not r]
        elif prev == QUEUED:
            self.wait.remove(r)
        if not self.step_pending and (self.wait or self.running):
            self._schedule_step(now)

    # -- scheduler (§2.7)
    def _order_waitq(self):
        s = self.cfg.scheduler
        if s == "fcfs":
            return
        if s == "priority-fcfs":
            self.wait.sort(key=lambda x: (x.priority, x.arrival, x.sort_id))
        elif s == "sjf":
            self.wait.sort(key=lambda x: (x.input_len, x.arrival, x.sort_id))
        elif s == "reverse-priority":
            self.wait.sort(key=lambda x: -x.priority)
        else:
            raise ValueError(f"unknown scheduler {s!r}")

    # -- preemption (§2.5, §2.6)
    def _pick_victim(self) -> int:
        if self.cfg.preemption_policy == "priority":
            best = len(self.running) - 1
            bk = (self.running[best].priority, self.running[best].arrival)
            for i in range(len(self.running) - 2, -1, -1):
                k = (self.running[i].priority, self.running[i].arrival)
                if k > bk:
                    best, bk = i, k
            return best
        return len(self.running) - 1

    def _alloc_with_preemption(self, r: _Req, idx: int, start: int, end: int, st: dict):
        """Returns (ok, idx). Victims go back to the head of the wait queue."""
        while not self.kv.allocate(r, start, end):
            if not self.running:
                return False, idx
            st["preempted_flag"] = True
            vi = self._pick_victim()
            v = self.running.pop(vi)
            if v.num_new > 0:
                st["budget"] += v.num_new
            v.num_new = 0
            v.state = QUEUED
            v.pi = 0
            v.computed = 0
            v.itl = []
            v.ttft = None
            v.num_preemptions += 1
            self.kv.release(v)
            self.wait.insert(0, v)
            self.c["preemption_count"] += 1
            st["preempted"].append(v.request_id)
            if v is r:
                return False, idx
            if vi < idx:
                idx -= 1
        return True, idx

    # -- batch formation (§2.5)
    def _form_batch(self, now: int) -> dict:
        cfg = self.cfg
        mml = cfg.max_model_len
        C = cfg.long_prefill_token_threshold
        st = {"budget": cfg.max_num_batched_tokens, "preempted_flag": False,
              "preempted": [], "admitted": []}
        for x in self.running:
            x.num_new = 0
        # phase 1: running requests
        i = 0
        while i < len(self.running):
            if st["budget"] <= 0:
                break
            r = self.running[i]
            if r.pi < r.input_len:
                n = r.input_len - r.pi
                if 0 < C < n:
                    n = C
                n = min(n, st["budget"])
                if mml > 0:
                    n = min(n, max(mml - 1 - r.pi, 0))
                ok, i = self._alloc_with_preemption(r, i, r.pi, r.pi + n, st)
                if not ok:
                    break
                st["budget"] -= n
                r.num_new = n
                r.computed += n
            elif r.output_len > 0:
                if mml > 0 and r.pi + 1 > mml - 1:
                    i += 1
                    continue
                ok, i = self._alloc_with_preemption(r, i, r.pi, r.pi + 1, st)
                if not ok:
                    break
                st["budget"] -= 1
                r.num_new = 1
            i += 1
        self._admit_new(now, st)
        return st

    def _admit_new(self, now: int, st: dict) -> None:
        """Phase 2: new requests from the wait queue, head of line."""
        cfg = self.cfg
        while (len(self.running) < cfg.max_num_seqs and self.wait and st["budget"] > 0
               and not st["preempted_flag"]):
            r = self.wait[0]
            cached = self.kv.cached_blocks(r)
            start = len(cached) * cfg.block_size
            n = self._chunk_tokens(r, start, st)
            if not self.kv.allocate(r, start, start + n, cached):
                break
            self.wait.pop(0)
            self.running.append(r)
            r.state = RUNNING
            r.num_new = n
            r.computed = start + n
            st["budget"] -= n
            r.sched_delay = now - r.arrival
            st["admitted"].append(r.request_id)

    def _chunk_tokens(self, r, start: int, st: dict) -> int:
        """A new request's first chunk from token `start`: the rest of its prompt, capped by the
        long-prefill threshold, the step's token budget and max-model-len."""
        cfg = self.cfg
        n = r.input_len - start
        if 0 < cfg.long_prefill_token_threshold < n:
            n = cfg.long_prefill_token_threshold
        n = min(n, st["budget"])
        if cfg.max_model_len > 0:
            n = min(n, max(cfg.max_model_len - 1 - start, 0))
        return n

    # -- hooks for engines built on this one (tests/reference_tiered.py, tests/reference_offload.py)
    def _extra_step_us(self) -> int:
        """Time added to the step being executed (beyond the latency model's)."""
        return 0

    def _after_execution(self) -> None:
        """Runs between a step's execution and its completions."""

    def _after_completions(self, end: int, done: list) -> None:
        """Runs after a step's completions (`done`: the ids that left), `end` = the step's end."""

    # -- one engine step (§2.4)
    def _step(self, now: int):
        if not self.running and not self.wait:
            self.step_pending = False
            return
        self.c["step_count"] += 1
        self._order_waitq()
        st = self._form_batch(now)
        sched = [r for r in self.running if r.num_new > 0]
        feats = [(r.pi < r.input_len, r.num_new, r.pi, r.input_len) for r in sched]
        dt = max(1, int(self.lat.step_time(feats))) + self._extra_step_us()
        if self.record_steps:
            log = [(r.request_id, r.num_new, r.pi) for r in self.running]
        a2 = self.lat.output_token_time
        for r in self.running:
            if r.pi < r.input_len:
                r.pi = r.computed
            elif r.num_new > 0:
                r.pi += 1
                r.itl.append(dt + a2)
            if r.pi == r.input_len and r.ttft is None:
                r.ttft = now + dt + a2 - r.arrival
        self._after_execution()
        # completions
        mml = self.cfg.max_model_len
        done = []
        keep = []
        for r in self.running:
            if r.pi >= r.input_len + max(r.output_len, 1) - 1:
                if r.output_len > 0 and r.pi < r.input_len + r.output_len:
                    self.kv.allocate(r, r.pi, r.pi + 1)
                self.kv.release(r)
                r.state = COMPLETED
                self._complete(r)
                self._push(now + dt, EV_LEFT, "left", r)
                done.append(r.request_id)
            elif mml > 0 and r.pi >= mml - 1:
                self.kv.release(r)
                r.state = LENGTH_CAPPED
                self.c["length_capped"] += 1
                self._complete(r, capped=True)
                self._push(now + dt, EV_LEFT, "left", r)
                done.append(r.request_id)
            else:
                keep.append(r)
        self.running = keep
        self._after_completions(now + dt, done)
        if self.record_steps:
            self.steps.append(StepRecord(now, dt, log, st["admitted"], st["preempted"], done))
        if self.running or self.wait:
            self._schedule_step(now + dt)
        else:
            self.step_pending = False

    def _complete(self, r: _Req, capped: bool = False):
        n = r.pi - r.input_len
        if n < r.output_len:
            n += 1
        if capped:
            n = max(self.cfg.max_model_len - 1 - r.input_len, 0)
        r.output_tokens = n
        ttft = r.ttft if r.ttft is not None else 0
        r.e2e = ttft + sum(r.itl) + (self.lat.post_decode_time if r.output_len > 0 else 0)
        self.c["completed"] += 1
        self.c["total_output_tokens"] += n

    def _finalize(self) -> SimResult:
        out = {}
        for r in self.reqs:
            out[r.request_id] = {
                "status": r.state,
                "ttft_us": r.ttft,
                "e2e_us": r.e2e if r.state in (COMPLETED, LENGTH_CAPPED) else None,
                "itl": list(r.itl),
                "sched_delay_us": r.sched_delay,
                "output_tokens": r.output_tokens,
                "num_preemptions": r.num_preemptions,
            }
        c = dict(self.c)
        c["kv_hits"] = self.kv.hits
        c["kv_misses"] = self.kv.misses
        tot = self.kv.hits + self.kv.misses
        c["cache_hit_rate"] = self.kv.hits / tot if tot else 0.0
        c["still_queued"] = len(self.wait)
        c["still_running"] = len(self.running)
        c["sim_end_us"] = min(self.clock, self.cfg.horizon_us)
        return SimResult(out, c, self.steps)


def simulate(requests, cfg: EngineConfig, lat: LatencyHooks,
             record_steps: bool = True) -> SimResult:
    return ReferenceEngine(requests, cfg, lat, record_steps).run()
