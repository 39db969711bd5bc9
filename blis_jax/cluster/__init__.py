"""Cluster-level decisions of BLIS (blis-features §3.1-§3.6, §3.10) as pure, jittable functions
and policy modules (admission and routing policies: `eqx.Module`s with a pure decision method).

Design note: how these pieces plug into a shared-clock loop
-----------------------------------------------------------

The cluster runs I instance slots (static, e.g. 64; `active` masks the ones that exist) on
one int64 µs clock. Per-instance engine state is stacked on a leading instance axis and the
per-instance handlers are `vmap`ped over it. Every function here is branch-free over arrays
of shape [I] (or scalars), so it can sit in the body of the engine's `lax.while_loop`.

Cluster state (one `eqx.Module`, carried by the loop) holds:

* `admission`: an `AbstractAdmission` (token-bucket level and last refill time).
* `in_flight: Int64[I]`: router-owned; +1 at routing, -1 (clamped at 0) per request that
  completes, is dropped or times out at that instance (blis-features §3.1).
* `snapshot: signals.Snapshot`: the stale copy of the instance-reported signals, with its
  per-instance last refresh time.
* `cache_signal: signals.CacheSignal`: the frozen copy of every instance's prefix-cache
  contents (whatever pytree the engine uses to answer prefix queries), with the last freeze.
* `routing`: an `AbstractRouting` (`RoundRobin` with its counter, `LeastLoaded`,
  `AlwaysBusiest`, or `Weighted` with its `scorers.ScorerProfile`: weights plus the
  prefix-affinity index and no-hit-lru stamps); with PD pools, a pool with scorers of its own
  has its own `Weighted` policy, and pools without share the cluster's (one round-robin
  counter for both picks).
* the Go `math/rand` streams of the random tie-breaks (`router`, `prefill-router`,
  `decode-router`), drawn only when a decision ties.

What the engine must provide per instance, at a routing decision:

* live `signals.InstanceSignals` (queue depth, batch size, KV utilization, free blocks,
  KV tokens in use / capacity, cache hit rate, preemptions);
* the live prefix-cache pytree (for `refresh_cache_signal`), and a function from (frozen
  cache pytree, request) to `cached_prefix_blocks[I]` = leading full prompt blocks present;
* the request's `block_keys` (content keys of its full prompt blocks, the engine's hash
  stand-ins) and `input_len` (shared prefix included), for `scorers.RouteRequest`;
* completions/drops/timeouts per instance per event (to decrement `in_flight`);
* for PD: prefill completion detection (at the prefill step's *start* tick) and
  `kv_bytes_per_token` of the prefill pool's TP.

Pipeline for one request (blis-features §3.2), cluster events first at equal times:

    t_adm   = arrival + admission_latency : state.admission, ok = admission.admit(state.admission, t_adm, input_len)
    t_route = t_adm + routing_latency     : snapshot = signals.refresh(snapshot, live, t_route, routable)
                                            cache_signal = signals.refresh_cache_signal(cache_signal, live_cache, t_route)
                                            rs = signals.router_state(snapshot, in_flight, routable)
                                            routing, target, stream = routing.route(rs, req, stream)
                                            (target -1 => routing rejection)
                                            in_flight[target] += 1; inject into the target at t_route
    PD (decode-first): target over the decode-role mask, pd.disaggregate(cfg, input_len,
        cached_prefix_blocks[target], block_size); if so, a prefill target over the prefill-role
        mask; at prefill completion, a transfer of pd.transfer_time_us(...) µs, then the decode
        sub-request is enqueued on the decode target. Shared pods (`--prefill-decode-instances`)
        are in both masks; each lane's output length per request is then loop state (0 for a
        prefill sub-request), so one pod can prefill and later decode the same request.

Float parity: XLA on CPU turns `x / c` (c a constant or a broadcast scalar, also one that
vmap broadcasts) into `x * (1/c)`, and fuses `a * b + c` into one FMA; both change the last
bit relative to Go. The float64 maths here goes through `_numerics.exact_div` / `rounded`,
so token levels, scores and transfer times round exactly as BLIS's do.

Open points for integration (not decidable from the spec alone): whether BLIS also builds a
RouterState (and so refreshes the stale snapshot) at the admission decision; see each module.
"""

from blis_jax.cluster.admission import ADMISSION_POLICIES as ADMISSION_POLICIES
from blis_jax.cluster.admission import AbstractAdmission as AbstractAdmission
from blis_jax.cluster.admission import AlwaysAdmit as AlwaysAdmit
from blis_jax.cluster.admission import RejectAll as RejectAll
from blis_jax.cluster.admission import TokenBucket as TokenBucket
from blis_jax.cluster.admission import admit as admit
from blis_jax.cluster.admission import make_admission as make_admission
from blis_jax.cluster.admission import token_bucket as token_bucket
from blis_jax.cluster.pd import PD_DECIDERS as PD_DECIDERS
from blis_jax.cluster.pd import PDConfig as PDConfig
from blis_jax.cluster.pd import disaggregate as disaggregate
from blis_jax.cluster.pd import make_pd_config as make_pd_config
from blis_jax.cluster.pd import pool_masks as pool_masks
from blis_jax.cluster.pd import transfer_blocks as transfer_blocks
from blis_jax.cluster.pd import transfer_time_us as transfer_time_us
from blis_jax.cluster.routing import ROUTING_POLICIES as ROUTING_POLICIES
from blis_jax.cluster.routing import AbstractRouting as AbstractRouting
from blis_jax.cluster.routing import AlwaysBusiest as AlwaysBusiest
from blis_jax.cluster.routing import LeastLoaded as LeastLoaded
from blis_jax.cluster.routing import RoundRobin as RoundRobin
from blis_jax.cluster.routing import Weighted as Weighted
from blis_jax.cluster.routing import make_routing as make_routing
from blis_jax.cluster.scorers import DEFAULT_PROFILE as DEFAULT_PROFILE
from blis_jax.cluster.scorers import SCORERS as SCORERS
from blis_jax.cluster.scorers import RouteRequest as RouteRequest
from blis_jax.cluster.scorers import ScorerProfile as ScorerProfile
from blis_jax.cluster.scorers import make_profile as make_profile
from blis_jax.cluster.scorers import parse_profile as parse_profile
from blis_jax.cluster.scorers import route_request as route_request
from blis_jax.cluster.signals import CacheSignal as CacheSignal
from blis_jax.cluster.signals import InstanceSignals as InstanceSignals
from blis_jax.cluster.signals import RouterState as RouterState
from blis_jax.cluster.signals import Snapshot as Snapshot
from blis_jax.cluster.signals import effective_load as effective_load
from blis_jax.cluster.signals import init_cache_signal as init_cache_signal
from blis_jax.cluster.signals import init_snapshot as init_snapshot
from blis_jax.cluster.signals import refresh as refresh
from blis_jax.cluster.signals import refresh_cache_signal as refresh_cache_signal
from blis_jax.cluster.signals import router_state as router_state
