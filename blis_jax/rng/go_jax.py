"""Go `math/rand` v1 source as a JAX value: a stream carried in a jitted loop's state.

BLIS's router draws `Intn(n)` from its own Go source, only when a routing decision ties
(blis-rng.md §10.1). The source is small — 607 64-bit words and two indices — so it lives in
the cluster loop state, stays jit-compiled and vmappable (one per sweep lane), and each draw is
Go's: the lagged-Fibonacci step, then `Int31n`'s rejection loop.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int64, UInt64

from blis_jax.rng.go_rand import LEN, GoRand

_MASK63 = np.uint64((1 << 63) - 1)


class GoStream(eqx.Module):
    vec: UInt64[Array, " 607"]
    tap: Int64[Array, ""]
    feed: Int64[Array, ""]


def go_stream(seed: int) -> GoStream:
    """A fresh Go source seeded with `seed` (signed int64)."""
    vec, tap, feed = GoRand(seed).register()
    return GoStream(vec=jnp.asarray(vec, jnp.uint64), tap=jnp.asarray(tap, jnp.int64),
                    feed=jnp.asarray(feed, jnp.int64))


def _next(s: GoStream) -> tuple[GoStream, UInt64[Array, ""]]:
    tap = (s.tap - 1) % LEN
    feed = (s.feed - 1) % LEN
    x = s.vec[feed] + s.vec[tap]
    return GoStream(vec=s.vec.at[feed].set(x), tap=tap, feed=feed), x


def _int31(s: GoStream) -> tuple[GoStream, Int64[Array, ""]]:
    s, x = _next(s)
    return s, ((x & _MASK63) >> np.uint64(32)).astype(jnp.int64)


def intn(s: GoStream, n: Int64[Array, ""]) -> tuple[GoStream, Int64[Array, ""]]:
    """Go's `Intn(n)` for 1 ≤ n < 2³¹ (`Int31n` with its rejection loop)."""
    n = jnp.maximum(jnp.asarray(n, jnp.int64), 1)
    pow2 = (n & (n - 1)) == 0
    top = (1 << 31) - 1 - (1 << 31) % n
    s, v = _int31(s)
    s, v = jax.lax.while_loop(lambda c: ~pow2 & (c[1] > top), lambda c: _int31(c[0]), (s, v))
    return s, jnp.where(pow2, v & (n - 1), v % n)


def intn_if(s: GoStream, n: Int64[Array, ""], draw: Bool[Array, ""]) -> tuple[GoStream, Int64[Array, ""]]:
    """`Intn(n)` when `draw`, else no draw (the stream unchanged) and 0."""
    drawn, v = intn(s, n)
    return jax.tree.map(lambda a, b: jnp.where(draw, a, b), drawn, s), jnp.where(draw, v, 0)
