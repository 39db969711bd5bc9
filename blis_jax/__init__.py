"""blis-jax: a vectorized batch-step simulator of LLM inference serving.

x64 is switched on here, before any array can be created: simulated time is int64
microseconds and latency maths is float64 (float32 time is wrong after ~17 s).
"""

import jax as _jax

_jax.config.update("jax_enable_x64", True)

__version__ = "0.1.0"
