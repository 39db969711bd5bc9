"""Float64 helpers that keep Go's exact IEEE operations under XLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array


@jax.custom_batching.custom_vmap
def _div_same_shape(num: Array, den: Array) -> Array:
    # The barrier hides where `den` came from (a constant, a broadcast scalar), so XLA keeps
    # a true elementwise division.
    return num / jax.lax.optimization_barrier(den)


@_div_same_shape.def_vmap
def _div_vmap(axis_size, in_batched, num, den):
    # vmap would otherwise divide by an unbatched (broadcast) divisor, the pattern XLA
    # rewrites; give both operands the batch axis explicitly.
    num_b, den_b = in_batched
    if not num_b:
        num = jnp.broadcast_to(num, (axis_size, *jnp.shape(num)))
    if not den_b:
        den = jnp.broadcast_to(den, (axis_size, *jnp.shape(den)))
    return _div_same_shape(num, den), True


def exact_div(num: Array, den: Array) -> Array:
    """`num / den` rounded once, as Go computes it.

    XLA's algebraic simplifier rewrites a division by a constant, or by a broadcast scalar
    (also one that vmap broadcasts), into a multiplication by the reciprocal, which can differ
    in the last bit (x / 1e6 != x * 1e-6 for about a third of all x). This keeps a true
    elementwise division under jit and vmap.
    """
    num, den = jnp.broadcast_arrays(jnp.asarray(num), jnp.asarray(den))
    return _div_same_shape(num, den)


def rounded(x: Array) -> Array:
    """`x` rounded to float64 before it is used (an identity on values, NaN included).

    XLA on CPUs with FMA contracts `a * b + c` into one fused multiply-add (one rounding
    instead of two), unlike Go on amd64. Passing the product through a select breaks the
    multiply-to-add chain that the contraction needs.
    """
    return jnp.where(x == x, x, jnp.nan)  # noqa: PLR0124 (the self-comparison is the point)
