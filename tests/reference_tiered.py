"""Eager reference of BLIS's legacy CPU KV tier (`--kv-cpu-blocks`, `sim/kv/tiered.go`) on top of
the pure-Python engine (reference_engine.py). Test oracle only.

What it reproduces (each point needed by the blis-diff case G01, which it matches request by
request; found by reading BLIS's outputs, blis-features §2.10 is less precise):

* After each step's execution (before completions) every hashed block of the running batch is
  written to an LRU CPU store, in batch order and block order (an entry already there is touched;
  a new one evicts the least recently used entry when the store is full).
* Allocating a new request (one that holds no blocks) with new tokens first reloads: from the first
  full prompt block past the GPU-cached prefix, blocks on CPU and not on the GPU, stopping at the
  first CPU miss, at a block the GPU holds (checked block by block: one the reload itself popped
  no longer counts) and after as many reloads as the free list had blocks. Each reload pops the free-list
  head -- possibly one of the request's own cached blocks, which are only claimed later: that
  block is re-keyed and its place in the prefix lost -- takes the block's key and goes back to the
  free-list tail with refcount 0; it adds the reload time to the current step.
* The request's chunk (NumNewTokens) was fixed by batch formation from the GPU-cached prefix before
  the reload and is not shortened.
* After a reload the request claims the GPU-cached prefix as it is now (looked up again), at most
  the blocks its chunk reaches; the chunk's tokens past that prefix get new blocks. When the
  prefix ends before the chunk's start (own blocks re-keyed), or reaches past the chunk's end,
  the blocks the request then allocates sit at other token positions than their index (unless
  the chunk ends on a block boundary: then they follow the prefix at their own positions, with
  their real keys): BLIS hashes them to keys nothing else has, and stores them on CPU (here: a
  key with offset -1 or the gap). The request's
  cached blocks that the reload re-keyed count as cache hits all the same.
* Without a reload the allocation is the GPU's own.

`no_rollback=True` (default off; not yet BLIS's G02, see below): when the allocation of the
rest fails after a reload, the claimed prefix stays committed to the waiting request (refcount,
off the free list, its hits counted), as the G02 notes describe BLIS; the request's retries then
allocate past the blocks it holds without claiming them again, and a failed retry counts as a CPU
miss. With the default the failed allocation claims nothing.

G02 is reproduced by neither. Both are identical to BLIS up to 3.376 s, and to each other up to
the first allocation that fails after a reload (3.777 s: request 28, just preempted, reloads one
block into one of its own cached blocks, its prefix shrinks and the rest no longer fits). By
4.17 s BLIS's steps run ~11 ms behind those of the run without the CPU tier (request 13's E2E;
that run, reference_engine alone, is exact against key_outcomes.without_offload), and BLIS
preempts only 26-28 there (24 and 25 keep their first TTFTs; 26 is back at 4.167 s with a few
tokens, 27 and 28 at 4.182 s in an ~18.3 ms step). With `no_rollback` the steps run ~7 ms ahead
of the run without the tier instead: holders 28, 27, then 26 starve the batch and 24 and 25 are
preempted too (214 preemptions in all vs BLIS's 189, cache hit rate 0.642 vs 0.653). Without it
28's reloads re-key its own blocks step after step (~250 reloads) and the steps run ~8 ms behind
BLIS (64 preemptions). Re-claiming the held prefix on a retry, reloading again on a retry (the
whole prefix held), holding only the reloaded blocks (no reload on retries), or reloading only into
the free blocks beyond the request's own cached ones do not reproduce that window either (tried
here; each keeps 8 of 500 requests exact).
Two leads (tried here, not built in):
* Hold only the blocks the failed attempt reloaded (not the rest of its prefix), and let every
  retry reload again past the GPU-cached prefix: the waiting request's other cached blocks are
  then re-keyed by its own reloads retry after retry while the reloaded ones pile up held. This
  gives BLIS's set of preempted requests in that window (26-28 only), re-admissions near BLIS's
  (26 and 27 at 4.175 s, 28 at 4.193 s vs 4.167 and 4.182 s), and from 4.2 s the running
  requests' E2Es within 2-3.5 ms of BLIS's; but at 4.16 s the steps run 7 ms ahead (BLIS has
  ~100 more reloads by then), 26 fails its
  re-admission at the step where BLIS admits it (its reload re-keys its own blocks again), and
  over the run: 229-255 preemptions vs 189, cache hit rate 0.67-0.68 vs 0.653, KV thrashing rate
  0.889 vs 0.881.
* Commit the reloaded prefix only when all its blocks, those in use by running requests included,
  fit in the free count, else fail holding nothing: 28 holds (its blocks are all free), 27 does not
  (64 shared with running requests) and re-keys its own blocks retry after retry. Request 13's E2E
  comes within 1.4 ms of BLIS's and 27 and 28 are admitted 1.4 ms after BLIS's 4.182 s, G01 is
  untouched (no reload there fails that check), but 26 is never preempted (108 preemptions).

Later search (issue #24, session g02; no mode adopted, none is exact past the 8 requests). BLIS
reference points in the window (metrics.json scheduling delays): 26 last admitted at 4.1673 s (a
few tokens: it was preempted shortly before), 27 and 28 at 4.1822 s, 29 and 30 at 4.2156 s; 13
completes in the step ending 4.1822 s (+11.2 ms vs the run without the tier). G01 has no
allocation that fails after a reload, so every failure-path variant below keeps G01 at 600/600:
only G02 constrains it. Figures: preemptions (BLIS 189) / cache hit rate (0.6533) / TTFT and
E2E means in ms (538.0 / 2952.6) / requests with TTFT within 2 ms and E2E within 5 ms of BLIS.
* rollback (default): 64 / 0.577 / 346 / 2804 / 62, 59. no_rollback: 214 / 0.642 / 506 / 2901 /
  127, 79 (24 and 25 preempted in the window, 13's E2E 18 ms early).
* lead 1: 243 / 0.668 / 554 / 2970 / 134, 124 -- the best global agreement, window 7 ms fast
  (28 loses its prefix to its own reloads and recomputes 1204 tokens at 4.193 s).
* lead 2: 123 / 0.613 / 375 / 2778 / 95, 104 -- the best window: 13's E2E 0.5 ms early, 27 and
  28 admitted at 4.1818 s, 29 and 30 at 4.2165 s, TTFTs of 27-41 within 1.2 ms; it lacks 26's
  preemption (one block short near 4.15 s) and next diverges at 5.19 s (42 admitted at 5.203 s,
  BLIS ~5.49 s: a waiting request whose reloads fill the whole free list, claim 78 > free 14,
  holds nothing and re-keys them step after step).
* lead 2 plus holding when the claim's free blocks are the whole free list: 184 / 0.638 / 447 /
  2848 / 83, 70 (25 preempted at 4.144 s, BLIS not). Lead 2 where a request failing the fit
  check holds lead-1 style (its reloaded blocks, retries reload): 188 / 0.630 / 528 / 2927 /
  51, 71 -- global means closest, window wrong (24, 25 preempted). Lead 2 plus the reloaded
  block outside the prefix (28's) held too: 138, window +3 ms, 26 still not preempted. Lead 2
  with the failing claim moved to the free-list tail (a claim then release): 121, window +7 ms.
  Lead 2 else holding the reloaded blocks with no retry reload: 119 (27 admitted at 3.85 s).
* no_rollback with retries charging the held blocks' reload time again: 228 (13 16 ms early);
  with a failed attempt charging no reload time: 218; a failed retry dropping the hold: 131;
  each retry releasing the hold and allocating anew (reload, claim, hits counted again):
  170 / 0.819, 13 26 ms late. Holding the prefix with retries reloading and re-claiming: 443.
  Holding only the reloaded blocks, retries allocating past them unclaimed: 68 (28's tail fits
  at once, TTFT 3.808 s); with retry reloads: 108. Lead 1 charging the held blocks each retry:
  364; charging the prefix growth: unchanged (the re-keyed gap walks down, the prefix never
  reaches the held blocks).
* Lead 2 plus the tail's fresh blocks popped one by one until the free list runs out and kept
  too (a partial tail allocation not rolled back; first failure only): 152 / 0.618 / 395 / 2799
  / 122, 105 -- fixes 43 and 44 at 5.5 s (TTFT within 0.4 ms; in lead 2 44's held claim leaves 6
  blocks free), but 28 then holds 78 blocks, not 77, and the first window runs 3.4 ms late (27
  never re-admitted before 4.18 s); 42 still admitted at 5.203 s. With retries popping partially
  too: 624. No_rollback plus the partial tail: 347. Lead 2 with a strict fit (claim < free):
  98 / 0.618 / 371 / 2798 / 138, 104, the same window TTFTs but E2Es 50-130 ms late after 4.2 s.
* In every variant the failing head (27 in the window) re-keys each step the blocks it reloaded
  the step before (prefix 64 + k, then 64: the reload pops the free-list head, which is its own
  previous reloads once the free list is only those): 5-23 reloads a step, the likely source of
  BLIS's extra step time; BLIS's 26 (preempted just before 4.1673 s) fits 27 holding the k
  reloaded blocks when they are the whole free list at ~4.15 s, but that rule also fires at
  4.02 s (see "holding when the claim's free blocks are the whole free list" above).
* No reload when the plain allocation cannot fit: 54 (G01 still exact).
* The notes' rollback patch (91 preemptions in BLIS) is not our default (64): a claim released
  again to the free-list tail (last block first, as BLIS releases) gives 78, first block first 48.
  So the failure path differs from BLIS before any holding; a fit of the rollback case (91)
  would be the next step, then the hold on top of it.

Session g02, second search (no mode adopted; 8 of 500 exact in every variant below; G01 stays
600/600 in each unless said). Same figures as above, "TTFT 2 ms" = requests with TTFT within 2 ms.
* Fits of the rollback patch (BLIS 91), all else the default: the reload loop running while the
  free list is non-empty instead of at most its length at the start 84 (G01 never reaches that
  bound); that plus the failed claim released to the tail 101; no reload time charged on a failed
  allocation 55 (with the unbounded loop 70; with the release 54); a GPU-held block skipped
  instead of stopping the reload 49. None gives 91; the figure depends on too many unknowns
  (all variants move it by 10-40) to pin the failure path alone.
* Rules confirmed by G01 (each variant breaks it): the reload pops the free-list head (tail: 50 of
  600 exact), puts the reloaded block back at the tail (re-keying free blocks in place from the
  head, leaving them there: 77 of 600), and claims the re-looked-up prefix, not batch formation's
  cached list (that list, re-keyed blocks included: G01 timings exact but hit rate 0.6960 and KV
  thrashing 0.6116, vs 0.6956 and 0.6144). G01 has 4 reloads that re-key the request's own cached blocks (73 blocks)
  and none that fails.
* The stop rule checked block by block stays: listing the blocks to reload before popping any
  (G01 exact) cuts the failing head's reloads and runs the window 8.5 ms fast (lead 2: 120).
* Check from the prefix (cfp): when the reload re-keyed own blocks (prefix ends before the chunk's
  start) the fit check counts the tail from the prefix end, the allocation still being G01's
  (from the chunk's start, shifted keys). With lead 2: 111 / 0.618 / 407 / 2811 / TTFT 2 ms 119
  (lead 2: 104), TTFT 2 ms and E2E 5 ms 65 (55); 27 is no longer admitted at 3.945 and 4.040 s
  with a hole before its chunk (preempted once, not 3 times) and 13's E2E is +1.4 ms. With
  no_rollback: 215; with the default: 59.
* The window is BLIS's to 0.3 ms with lead 2 + cfp, holders' retries reloading past their held
  prefix (then claiming the rest of the prefix and the tail, or holding on), and one hold forced
  by time: 27 holding its claim (64 shared blocks + the 10 it reloaded, the whole free list) at
  4.137 s. Then 26 is preempted at 4.153 s and re-admitted at 4.1676 s (BLIS 4.1673), 13 ends in
  that step (E2E +0.3 ms), 27 and 28 are admitted at 4.1825 s (4.1822) in an 18.29 ms step (BLIS
  18.3 ms: the two holders' retries reload 24 blocks) and 29 and 30 at 4.2160 s (4.2156). So in
  BLIS the failing head does not hold through 3.84-4.12 s (its reloads make the step times) but
  holds once near 4.137 s; what triggers that hold is not found: its attempts at 4.106 s and
  4.137 s are the same from its side (cached 64, reloads 64-73 into the 10 free blocks, which
  are its own earlier reloads, prefix 74, claim 74 of which 10 free, tail 23, nothing of its own
  re-keyed). Rules tried with cfp and retry reloads: lead 2 117 / 0.646 / 435 / 2864 (26 not
  preempted, 27 and 28 +2.9 ms); holding when the reloads are the whole free list and re-keyed
  nothing of its own 155 (fires from 3.976 s: 25 preempted); no_rollback 222. Without cfp,
  holding when the claim's blocks are all free or nothing of its own was re-keyed: 186 / 0.648 /
  481 / 2882 (preemptions nearest BLIS's, window wrong: 25 preempted, 13 14 ms early).
* Best agreement of this search (lead 2z): lead 2 whose failing claim is also held when none of
  its blocks is free (the request's own blocks all re-keyed: it holds only blocks in use by
  running requests, which costs no free block), cfp (on retries too), and retries reloading past
  the held prefix, claiming the rest only when it and the tail fit: 128 / 0.6515 / 378 / 2797 /
  TTFT 2 ms 125, TTFT 2 ms and E2E 5 ms 75 (the most of any variant; hit rate within 0.002).
  Its window lacks 26's preemption, but it shows where BLIS's hold may come from: 27 holds the
  64 shared blocks at 4.117 s (its reload re-keyed all its own), and its retry at 4.132 s
  reloads 12 blocks, the whole free list, that do not fit with the tail; holding them there is
  the forced hold above. A retry that holds its reloaded blocks whenever they fit (223) or
  when they are the whole free list (187) also fires at 3.79 s (28: 1 of 1 free) or 3.91 s (27:
  24 of 24) and preempts 24 and 25.

Session g02b: `partial_hold=True` (a fit, not BLIS's code; G01 stays 600/600, it never takes this
path) is BLIS's G02 to 0.5 ms up to 5.45 s: all 42 requests whose first token BLIS records before
5.45 s have their TTFT within 0.5 ms, all 19 that complete before then their E2E (default: 26 and
8; no_rollback: 24 and 8); tests/test_cpu_tier.py checks it. Whole run: 8 of 500 exact, 129
preemptions / hit rate 0.6591 / TTFT mean 424.0 / E2E mean 2848.9 / TTFT 2 ms 135 (the most of any
variant) / TTFT 2 ms and E2E 5 ms 72. Rule (lead 2 + cfp + retry reloads, plus one hold):
* The fit check counts the claim's free blocks plus the chunk's tail from the prefix end.
* A failed first allocation holds its claim when the claim, all its blocks counted, fits the free
  count (lead 2), or when its claim has no free block (only blocks in use by running requests)
  after a reload that re-keyed the whole free list, all of it the request's own cached blocks: a
  "shared holder".
* A holder's retry reloads past its held blocks and claims the rest of the prefix with the tail
  when both fit; a shared holder whose retry's reloads (the extra prefix's free blocks) are the
  whole free list holds them too.
Found by dumping 27's attempts 3.84-4.14 s: they alternate between cached 64 (a running request's
decode took the free-list head, its own reload of block 64, since its last attempt; it reloads
64-73 into the free list, claim 74 of which 10 free) and cached 74 (no block taken since: its
reload from 74 re-keys its own 64-73, claim = the 64 shared blocks). 4.121 s is the first attempt
of the second kind whose reloads are the whole free list (3.914 s: 7 of 25 free, 3.960 s: 10 of 24,
8 own, 4.042 s: 15 of 17): 27 holds the 64 shared blocks there (no free block taken), its retry at
4.137 s reloads 64-73, the whole free list, and holds them: the forced hold above, now by rule.
Variants: the retry holding its extra blocks when they fit the free count (not only equal) 129 /
0.6611 / 427.2 / 2850.2 / 119, 66; the shared hold without "all of it own" 165 / 0.6695 / 499.1 /
2932.2 / 91, 37 (same window); without the shared holder's retry hold 117, 26 not preempted (13's E2E
+1.4 ms); plus the tail's fresh blocks popped until the free list runs out 178 (28 holds 78 at
3.777 s, the window runs 2.4-2.9 ms fast from 4.19 s); a holder's blocks leaked on its admission
(shared holders only) same window, TTFT mean 2284 ms.
Next divergence: request 42. Here it is admitted at 5.0995 s with 40 and 41 (their TTFTs are
BLIS's) and has its first token at 5.139 s; BLIS's last admission of 42 is at 5.4971 s, with 43,
first token 5.5155 s, so BLIS likely preempts it in its prefill (steps up to ~5.21 s match: BLIS
would be short of a few free blocks there, where nothing is held here; 44 holds 58 from 5.220 s).
Here 43 alone is preempted at 5.25 s (re-admitted at 5.494 s, BLIS 5.4971) and 22 ends 3.3 ms
early (5.5056 s). Every step to 5.21 s is BLIS's to the microsecond (E2Es +324 us throughout). Forcing
43 to hold its claim at one of its failed attempts preempts 42 as BLIS does, but at 5.267 s (claim
89, 1 block left) 41 is preempted too, and at 5.283, 5.330 or 5.362 s 42 and 43 are re-admitted
together 6-8 ms before BLIS's 5.4971 s (the hold stops 43's reload churn; BLIS's steps there are
slower than these, 22's E2E says by 3.3 ms even without a hold): so BLIS likely has both 42 and 43
waiting and reloading from ~5.25 s, not a holder.

Session g02c (no rule adopted; partial_hold unchanged). BLIS's times in the window, read against
partial_hold (BLIS's admission times are 0.3 ms below the oracle's for the same step, its E2Es
0.324 ms): 22's last step ends when BLIS admits 42 and 43 together (5.4971 s; 22's E2E -3.3 ms
here, so BLIS's steps from ~5.20 s to there take 3.6 ms more, ~50 reloads' worth); that admission
step takes 18.4 ms in BLIS (here 43 alone, 437 tokens and 33 reloads: 19.8 ms), so 42's chunk and
the reloads there are small (42's own blocks still cached); 17's E2E and 44's admission follow at
BLIS's offset (-1.9 ms), 44's admission step is 0.7 ms shorter in BLIS. 11's E2E (exact) only
pins the steps up to the one starting 5.2023 s: 43's admission there and 44's hold at 5.2198 s are
not checked by BLIS's outputs. Forcings tried (each a one-off at a fixed time, none a rule; figures
are TTFT of 42 and 43, E2E of 22, 17, in ms vs BLIS; partial_hold: 42 -376, 43 -1.9, 22 -3.3,
17 -1.9):
* 42 preempted with 43 at 5.2515 s: 42 and 43 admitted together as in BLIS but -2.5 (42, now the
  queue head, is re-admitted at 5.267 s with 13 tokens and preempted again at 5.479 s when 43's
  shared hold takes the free list), 22 -2.9; 42 preempted alone at other steps 5.236-5.395 s:
  -1.9 to -4.6; 42 put behind 43 in the queue: -7.2.
* 44's hold at 5.2198 s also taking the 3 free blocks left (the partial tail, popped from the head;
  it then holds 61): 43 is preempted at 5.2357 s (one step earlier), 43 -0.2, 17 +0.3, 44 +0.8,
  22 -1.5, but 42 is never preempted (-376). The same partial tail for every first-failure hold
  from 4.19 s: 175 preemptions / 0.6354 / TTFT 550.6 / E2E 2994.2 (means nearest BLIS's of any
  variant), window as above until 44's admission at 5.547 s breaks (+682 ms; 46 holds there).
  Earlier it cannot apply: 28 at 3.777 s would hold 78, not 77 (that case's chunk also starts
  past a re-keyed own block, tail 2 vs 1 free, as 44's: 43 vs 3; what differs is not found).
* 44's hold at 5.2198 s also claiming the 3 blocks it reloaded (positions 61-63, past the gap its
  reload made at 58-60; they were the 3 free blocks left): 43 -0.3, 17 -0.3, 44 -0.0, 22 -1.5,
  18 -1.7, 42 still -376; whole run 144 / 0.6642 / 456.7 / 2884.3. As a rule (from 0 s) it breaks
  the 3.78 s window: 28 at 3.777 s is the same case (its free list was exactly its 78 cached
  blocks, its reload of 1 re-keyed its block 77, the one free block left is the reloaded 78) and
  BLIS has it hold 77 (claiming 78 there: 26's TTFT +15.5 ms, 27 and 28 -2.8 ms, also with a
  retry that reloads into the gap and claims the rest around the held blocks: 28's retries find
  the free list empty until 4.18 s, so BLIS has one more free block there); from 4.2 s on
  it fires only for 44 up to 5.5 s. Neither it nor the partial tail has a condition found that
  separates 44 from 28 (both lead-2 holds, claim all free, 1 vs 3 reloaded, tail 2 vs 43).
  With it, 42 preempted by force at one step from 5.236 to 5.480 s: 42 and 43 -0.8 to -2.6
  (best at 5.4797 s: -0.8, 22 -1.9, 44 -0.6), never BLIS's.
* That partial tail plus 42 preempted by force: at 5.2357 s -1.1 (22 -1.8); at 5.4797 s (after 43's
  reloads filled the free list, before the completion there) -0.6 (22 -1.9, 44 0.0); by a rule
  "a first allocation whose reloads re-keyed the whole free list (none of its own) holds its claim
  when the claim's free blocks are exactly those" at 5.4635 s only: -1.2 (admission step 19.1 ms:
  42 61 tokens, 43 325, 29 reloads); the same rule from 5.0 s fires at 5.3646 s: -5.1.
* 43's reloads not bounded by the free count (the loop running while the free list is non-empty)
  in 5.23-5.5 s: 43 +4.6, 22 +3.2 (with the partial tail +9.5); the bound sits between the two.
So BLIS has 42 waiting at its 43's admission, its free list empty a step earlier than here (~5.2357
s), and ~25-30 more reloads (or prefill) than here before 5.49 s; no single rule tried gives all
three. Harness: /tmp/g02c/h2.py (partial_hold plus one-off forcings PT/RH/FP/FILL/UNB, dumps).
"""

from __future__ import annotations

import math
from collections import OrderedDict

from reference_engine import KVCache, ReferenceEngine


def reload_from_cpu(kv: KVCache, req, cached, on_cpu) -> tuple[list, int]:
    """BLIS's reload: the full prompt blocks after the GPU-cached prefix `cached` that `on_cpu`
    holds (stopping at the first miss, or at a block the GPU has cached) go into free-list head
    blocks (possibly re-keying the request's own cached blocks), registered as cached with
    refcount 0 at the free list's tail. Returns the reloaded keys and how many of the request's
    own cached blocks were re-keyed."""
    bs = kv.bs
    n_full = req.input_len // bs
    j, keys, room = len(cached), [], len(kv.free)
    own, lost = set(cached), 0
    while j < n_full and len(keys) < room:
        key = kv.block_key(req, j, bs)
        if not on_cpu(key) or key in kv.by_hash:
            break
        b = kv.free.popitem(last=False)[0]
        lost += b in own
        kv._forget(b)
        kv.hash[b], kv.fill[b], kv.ref[b] = key, bs, 0
        kv.by_hash[key] = b
        kv.free[b] = None                      # back at the tail, refcount 0
        keys.append(key)
        j += 1
    return keys, lost


class TieredKVCache(KVCache):
    def __init__(self, total_blocks: int, block_size: int, cpu_blocks: int, reload_us: int, no_rollback: bool = False,
                 partial_hold: bool = False):
        super().__init__(total_blocks, block_size)
        if no_rollback and partial_hold:
            raise ValueError("no_rollback and partial_hold are two failure paths: set at most one")
        self.no_rollback = no_rollback
        self.partial_hold = partial_hold
        self.holders: set = set()    # waiting requests holding the prefix of a failed allocation
        self.shared_holders: set = set()   # partial_hold: holders of only blocks in use by running requests
        self.cpu_misses = self.reload_failures = 0
        self.cpu_blocks = cpu_blocks
        self.reload_us = reload_us
        self.cpu: OrderedDict = OrderedDict()   # key -> None, least recently used first
        self.stores = self.evictions = self.reloads = self.pending_us = 0
        self.restores = 0   # stores of a key this pass already had on CPU: the engine counts none (cpu_tier.mirror)

    def mirror(self, running):
        seen = set(self.cpu)    # on CPU at the start of the pass, or used earlier in it
        for r in running:
            for b in self.req_blocks.get(r.request_id, []):
                h = self.hash[b]
                if h is None:
                    continue
                if h in self.cpu:
                    self.cpu.move_to_end(h)
                    continue
                if len(self.cpu) >= self.cpu_blocks:
                    self.cpu.popitem(last=False)
                    self.evictions += 1
                self.cpu[h] = None
                self.stores += 1
                self.restores += h in seen   # evicted by this same pass before this use
                seen.add(h)

    def allocate(self, req, start, end, cached=()):
        if self.partial_hold:
            return self._allocate_partial_hold(req, start, end, cached)
        rid = req.request_id
        if rid in self.holders and end > start:
            # a retry: the blocks it holds are the start of its cached prefix; the chunk's blocks
            # follow them (at other token positions when the prefix grew meanwhile: unique keys)
            gap = start - len(self.req_blocks[rid]) * self.bs
            if gap:
                self.req_offset[rid] = gap
            ok = super().allocate(req, start, end, ())
            if ok:
                self.holders.discard(rid)
            self.cpu_misses += not ok
            return ok
        if self.req_blocks.get(rid) is not None or end <= start:
            return super().allocate(req, start, end, cached)
        bs = self.bs
        keys, lost = reload_from_cpu(self, req, cached, lambda key: key in self.cpu)
        reloaded = len(keys)
        self.pending_us += reloaded * self.reload_us
        self.reloads += reloaded
        if not reloaded:
            ok = super().allocate(req, start, end, cached)
            self.cpu_misses += not ok
            return ok
        prefix = self.cached_blocks(req)
        m = min(len(prefix), -(-end // bs))
        s = max(start, len(prefix) * bs)
        claim = prefix[:m]
        need = (-(-(end - s) // bs) if end > s else 0) + len({b for b in claim if self.ref[b] == 0})
        ok = need <= len(self.free)
        if not ok:
            self.reload_failures += 1
            if not self.no_rollback:
                return False
        self.hits += lost          # the request's cached blocks the reload re-keyed count as hits all the same
        if not ok and not claim:   # nothing to hold (the reload re-keyed the request's first block)
            return False
        blocks = self.req_blocks[req.request_id] = []
        if not ok:                 # no rollback: the prefix stays claimed while the request waits
            self.req_offset[rid] = s - len(prefix) * bs
            self._claim(blocks, claim)
            self.holders.add(rid)
            return False
        # a prefix past the chunk: the next chunk's blocks follow the claimed ones, at their own
        # token positions (real keys) if the chunk ends on a block boundary, else shifted (-1)
        self.req_offset[req.request_id] = (0 if end % bs == 0 else -1) if end <= s else s - len(prefix) * bs
        self._claim(blocks, claim)
        return True if end <= s else super().allocate(req, s, end, ())

    # -- partial_hold (G02 candidate, see the module docstring) ----------------------------------
    def _reload(self, req, cached) -> tuple[int, int]:
        keys, lost = reload_from_cpu(self, req, cached, lambda key: key in self.cpu)
        self.reloads += len(keys)
        self.pending_us += len(keys) * self.reload_us
        return len(keys), lost

    def _tail_need(self, end, prefix_len, new_free) -> int:
        """Free blocks the fit check asks for: the claim's free blocks plus the chunk's tail counted
        from the prefix end (also when the reload re-keyed own blocks and the prefix ends before the
        chunk's start)."""
        s = prefix_len * self.bs
        return new_free + (-(-(end - s) // self.bs) if end > s else 0)

    def _commit(self, req, blocks, claim, start, end, prefix_len) -> bool:
        """Claims `claim` after `blocks` and allocates the chunk's tail past the prefix (as the
        default path does once the check passed)."""
        bs, rid = self.bs, req.request_id
        s = max(start, prefix_len * bs)
        self._claim(blocks, claim)
        self.holders.discard(rid)
        self.shared_holders.discard(rid)
        self.req_offset[rid] = (0 if end % bs == 0 else -1) if end <= s else s - prefix_len * bs
        return True if end <= s else KVCache.allocate(self, req, s, end, ())

    def _allocate_partial_hold(self, req, start, end, cached):
        rid, bs = req.request_id, self.bs
        held = self.req_blocks.get(rid)
        if rid in self.holders and end > start:
            # a retry reloads past its held blocks; it claims the rest of the prefix only with the tail
            reloaded, _ = self._reload(req, cached)
            prefix = self.cached_blocks(req)
            if prefix[:len(held)] == held and len(prefix) > len(held):
                extra = prefix[len(held):min(len(prefix), -(-end // bs))]
                extra_free = sum(1 for b in extra if self.ref[b] == 0)
                if self._tail_need(end, len(prefix), extra_free) <= len(self.free):
                    return self._commit(req, held, extra, start, end, len(prefix))
                self.cpu_misses += 1
                if rid in self.shared_holders and extra_free == len(self.free):
                    self._claim(held, extra)    # its reloads were the whole free list: held too
                return False
            if prefix[:len(held)] == held:    # nothing past the held blocks: allocate after them
                start = max(start, len(held) * bs)
            gap = start - len(held) * bs      # as the no_rollback retry
            if gap:
                self.req_offset[rid] = gap
            ok = KVCache.allocate(self, req, start, end, ())
            if ok:
                self.holders.discard(rid)
                self.shared_holders.discard(rid)
            self.cpu_misses += not ok
            return ok
        if held is not None or end <= start:
            return KVCache.allocate(self, req, start, end, cached)
        reloaded, lost = self._reload(req, cached)
        if not reloaded:
            ok = KVCache.allocate(self, req, start, end, cached)
            self.cpu_misses += not ok
            return ok
        prefix = self.cached_blocks(req)
        claim = prefix[:min(len(prefix), -(-end // bs))]
        claim_free = sum(1 for b in claim if self.ref[b] == 0)
        if self._tail_need(end, len(prefix), claim_free) <= len(self.free):
            self.hits += lost      # the request's cached blocks the reload re-keyed count as hits all the same
            return self._commit(req, self.req_blocks.setdefault(rid, []), claim, start, end, len(prefix))
        self.reload_failures += 1
        # held: a claim that fits the free count on its own (all its blocks counted), or one of only
        # blocks in use by running requests after a reload that re-keyed the whole free list, all of
        # it the request's own cached blocks
        fits = len(claim) <= len(self.free)
        shared = not fits and claim_free == 0 and lost == reloaded == len(self.free)
        if not (fits or shared):
            return False
        self.hits += lost          # counted as in the no_rollback path, also with nothing to hold
        if not claim:
            return False
        blocks = self.req_blocks[rid] = []
        self.req_offset[rid] = max(start, len(prefix) * bs) - len(prefix) * bs
        self._claim(blocks, claim)
        self.holders.add(rid)
        if shared:
            self.shared_holders.add(rid)
        return False

    def release(self, req):
        self.holders.discard(req.request_id)
        self.shared_holders.discard(req.request_id)
        super().release(req)


class TieredEngine(ReferenceEngine):
    def __init__(self, requests, cfg, lat, cpu_blocks: int, reload_us: int, record_steps: bool = True,
                 no_rollback: bool = False, partial_hold: bool = False):
        super().__init__(requests, cfg, lat, record_steps)
        self.kv = TieredKVCache(cfg.total_kv_blocks, cfg.block_size, cpu_blocks, reload_us, no_rollback,
                                partial_hold)

    # the reload time is added to the step; the CPU write-through runs between execution and
    # completions (blis-features §2.4)
    def _extra_step_us(self) -> int:
        pending, self.kv.pending_us = self.kv.pending_us, 0
        return pending

    def _after_execution(self) -> None:
        self.kv.mirror(self.running)


def reload_time_us(block_size: int, bandwidth: float, base_latency: int) -> int:
    return int(base_latency) + math.ceil(block_size / bandwidth)


def simulate_tiered(requests, cfg, lat, cpu_blocks: int, reload_us: int, record_steps: bool = True,
                    no_rollback: bool = False, partial_hold: bool = False):
    eng = TieredEngine(requests, cfg, lat, cpu_blocks, reload_us, record_steps, no_rollback, partial_hold)
    return eng.run(), eng.kv
