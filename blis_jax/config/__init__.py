"""Configuration: YAML / HF config.json / fits → validated frozen dataclasses (no jax)."""

from blis_jax.config.coefficients import Coefficients as Coefficients
from blis_jax.config.coefficients import load_coefficients as load_coefficients
from blis_jax.config.hardware import GPUSpec as GPUSpec
from blis_jax.config.hardware import bundled_gpu_names as bundled_gpu_names
from blis_jax.config.hardware import load_gpu as load_gpu
from blis_jax.config.kv_capacity import auto_kv_blocks as auto_kv_blocks
from blis_jax.config.kv_capacity import auto_max_model_len as auto_max_model_len
from blis_jax.config.kv_capacity import kv_bytes_per_token as kv_bytes_per_token
from blis_jax.config.kv_capacity import model_weight_bytes as model_weight_bytes
from blis_jax.config.model import ModelArch as ModelArch
from blis_jax.config.model import arch_from_hf_config as arch_from_hf_config
from blis_jax.config.model import bundled_model_ids as bundled_model_ids
from blis_jax.config.model import load_model as load_model
from blis_jax.config.quantization import detect_weight_bytes as detect_weight_bytes
