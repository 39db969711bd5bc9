"""Latency models: float64 step time of a batch (trained-physics, roofline) and alpha terms."""

from blis_jax.latency.features import BatchFeatures as BatchFeatures
from blis_jax.latency.features import make_batch_features as make_batch_features
from blis_jax.latency.model import LatencyModel as LatencyModel
from blis_jax.latency.model import RooflineModel as RooflineModel
from blis_jax.latency.model import TrainedPhysicsModel as TrainedPhysicsModel
from blis_jax.latency.model import build_latency_model as build_latency_model
from blis_jax.latency.model import decode_run_step_times_us as decode_run_step_times_us
from blis_jax.latency.model import first_token_lag_float as first_token_lag_float
from blis_jax.latency.model import first_token_lag_us as first_token_lag_us
from blis_jax.latency.model import output_token_time_float as output_token_time_float
from blis_jax.latency.model import output_token_time_us as output_token_time_us
from blis_jax.latency.model import post_decode_time_float as post_decode_time_float
from blis_jax.latency.model import post_decode_time_us as post_decode_time_us
from blis_jax.latency.model import queueing_time_float as queueing_time_float
from blis_jax.latency.model import queueing_time_us as queueing_time_us
from blis_jax.latency.model import step_time_float as step_time_float
from blis_jax.latency.model import step_time_us as step_time_us
from blis_jax.latency.model import truncate_us as truncate_us
from blis_jax.latency.model import with_coefficients as with_coefficients
from blis_jax.latency.trained_physics import basis as trained_physics_basis  # noqa: F401
from blis_jax.latency.trained_physics import basis_vector as trained_physics_basis_vector  # noqa: F401
