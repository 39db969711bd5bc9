"""`BatchFeatures`: the per-slot arrays of one step's scheduled batch, padded to S slots.

Only slots with ``scheduled`` set reach the step-time maths (BLIS passes only requests with
NumNewTokens > 0 to StepTime); padded slots have ``scheduled=False`` and contribute nothing.
"""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int


class BatchFeatures(eqx.Module):
    """One step's batch. Shapes are ``[S]``; vmap adds leading axes."""

    scheduled: Bool[Array, " S"]  # NumNewTokens > 0 this step
    is_prefill: Bool[Array, " S"]  # ProgressIndex < InputLen (else decode)
    new_tokens: Int[Array, " S"]  # NumNewTokens (a decode counts as 1 whatever this says)
    progress: Int[Array, " S"]  # ProgressIndex before this step
    input_len: Int[Array, " S"]  # InputLen, the full prompt incl. any shared prefix

    @property
    def prefill(self) -> Bool[Array, " S"]:
        """Scheduled prefill slots."""
        return self.scheduled & self.is_prefill

    @property
    def decode(self) -> Bool[Array, " S"]:
        """Scheduled decode slots."""
        return self.scheduled & ~self.is_prefill


def make_batch_features(
    new_tokens, progress, input_len, num_slots: int | None = None
) -> BatchFeatures:
    """Build features from per-request lists (Python side, e.g. tests and tools).

    ``scheduled`` is ``new_tokens > 0`` and ``is_prefill`` is ``progress < input_len``;
    slots beyond the given requests (up to ``num_slots``) are padding.
    """
    new_tokens, progress, input_len = (
        np.asarray(x, dtype=np.int64).reshape(-1) for x in (new_tokens, progress, input_len)
    )
    n = new_tokens.shape[0]
    if not progress.shape[0] == input_len.shape[0] == n:
        raise ValueError("new_tokens, progress and input_len must have the same length")
    slots = n if num_slots is None else num_slots
    if slots < n:
        raise ValueError(f"num_slots {slots} is smaller than the {n} requests given")

    def pad(x):
        return np.concatenate([x, np.zeros(slots - n, dtype=np.int64)])

    new_tokens, progress, input_len = pad(new_tokens), pad(progress), pad(input_len)
    scheduled = new_tokens > 0
    return BatchFeatures(
        scheduled=jnp.asarray(scheduled),
        is_prefill=jnp.asarray(scheduled & (progress < input_len)),
        new_tokens=jnp.asarray(new_tokens),
        progress=jnp.asarray(progress),
        input_len=jnp.asarray(input_len),
    )
