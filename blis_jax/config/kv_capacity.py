"""KV-cache capacity auto-sizing and max-model-len derivation (spec latency-models §3.1-§3.2,
blis-features §2.14), as BLIS computes them when ``--total-kv-blocks`` is not given.

Pure Python integers and floats, no jax.
"""

from blis_jax.config.hardware import GPUSpec
from blis_jax.config.model import ModelArch
from blis_jax.errors import ConfigError

GIB = 2**30
SUPPORTED_ACTIVATIONS = ("silu", "swiglu", "geglu", "situ", "")
# Rope types whose factor does not extend the usable context (the model already states it).
_UNSCALED_ROPE_TYPES = ("su", "longrope", "llama3")


def model_weight_bytes(arch: ModelArch) -> int:
    """Total weight bytes (all GPUs), after llm-d's capacity planner: 3-matrix SwiGLU MLP,
    embeddings + lm_head (unless tied), attention, norms, routers."""
    d, L = arch.hidden_size, arch.num_layers
    # K/V projections use the explicit head_dim (Mistral-Nemo: 128, not d/H = 160).
    d_kv = arch.num_kv_heads * arch.capacity_head_dim
    attention = 2 * d * d + 2 * d * d_kv + 2 * d  # Q,O + K,V + the two norms
    if arch.is_moe:
        dense_layers = min(arch.first_k_dense_replace, L)
        moe_layer = 3 * d * arch.moe_ffn_dim * arch.num_experts + 3 * d * arch.shared_ffn_dim
        moe_layer += arch.num_experts * d  # router
        mlp = dense_layers * 3 * d * arch.dense_ffn_dim + (L - dense_layers) * moe_layer
    else:
        mlp = L * 3 * d * arch.intermediate_size
    params = arch.vocab_size * d + L * attention + mlp + d
    if not arch.tie_word_embeddings:
        params += arch.vocab_size * d
    return int(params * arch.weight_bytes_per_param)


def kv_bytes_per_token(arch: ModelArch, tp: int) -> float:
    """Per-GPU KV bytes of one token: standard K+V split over TP, or MLA latent (not split)."""
    b = arch.bytes_per_param
    if arch.is_mla:
        return float(arch.num_layers * (arch.kv_lora_rank + arch.qk_rope_head_dim) * b)
    return arch.num_layers * 2 * arch.capacity_head_dim * arch.num_kv_heads * b / tp


def kv_block_bytes(arch: ModelArch, tp: int, block_size: int) -> int:
    """Per-GPU KV bytes of one block (whole bytes): what auto-sizing divides the KV budget by, and
    the multi-tier offload's `per_block_bytes` (Llama-3.1-8B TP1, 16 tokens: 16 x 131072)."""
    return int(kv_bytes_per_token(arch, tp) * block_size)


def _overhead_gib(arch, tp, activation_gib, non_torch_gib, lora_reserve_gib) -> float:
    activation = activation_gib if activation_gib is not None else (8.0 if arch.is_moe else 5.5)
    non_torch = non_torch_gib if non_torch_gib is not None else (0.15 if tp == 1 else 0.6 * tp)
    return model_weight_bytes(arch) / GIB + activation + non_torch + lora_reserve_gib


def auto_kv_blocks(
    arch: ModelArch,
    gpu: GPUSpec,
    tp: int = 1,
    *,
    gpu_memory_utilization: float = 0.9,
    block_size: int = 16,
    dp: int = 1,
    activation_gib: float | None = None,
    non_torch_gib: float | None = None,
    lora_reserve_gib: float = 0.0,
) -> int:
    """Total KV blocks per instance, as BLIS auto-computes them.

    ``activation_gib`` defaults to 5.5 (dense) / 8.0 (MoE); ``non_torch_gib`` to 0.15 at TP1
    and 0.6·TP otherwise. Memory is ``memory_gib·utilization·tp`` while per-block bytes are
    already per GPU, so blocks grow roughly as TP² (the reference's convention).
    """
    name = arch.hf_id
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp = {tp!r} must be an integer >= 1")
    if not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block_size = {block_size!r} must be an integer >= 1")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization = {gpu_memory_utilization!r} must be in (0, 1]")
    if gpu.memory_gib is None:
        raise ConfigError(
            f"GPU {gpu.name!r} has no memory_gib, so KV blocks cannot be auto-computed; "
            "add memory_gib to its YAML or pass total KV blocks explicitly"
        )
    if arch.vocab_size <= 0:
        raise ConfigError(
            f"model {name!r}: vocab_size is missing; KV blocks cannot be auto-computed "
            "(pass total KV blocks explicitly)"
        )
    if arch.intermediate_size <= 0:
        raise ConfigError(
            f"model {name!r}: intermediate_size is missing; KV blocks cannot be auto-computed "
            "(pass total KV blocks explicitly)"
        )
    if arch.hidden_act.lower() not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(
            f"model {name!r}: hidden_act {arch.hidden_act!r} is not SwiGLU-family "
            f"({', '.join(a for a in SUPPORTED_ACTIVATIONS if a)}); KV blocks cannot be "
            "auto-computed (pass total KV blocks explicitly)"
        )
    if not arch.is_moe and (arch.num_shared_experts > 0 or arch.num_experts_per_tok > 0):
        raise ConfigError(
            f"model {name!r}: MoE fields (n_shared_experts / num_experts_per_tok) without a "
            "total expert count (num_experts, n_routed_experts, num_local_experts, ...); "
            "KV blocks cannot be auto-computed (pass total KV blocks explicitly)"
        )
    if not arch.is_mla and arch.num_kv_heads >= tp and arch.num_kv_heads % tp:
        raise ConfigError(
            f"model {name!r}: num_kv_heads {arch.num_kv_heads} is not divisible by tp {tp}"
        )

    def budget(t: int) -> float:
        available = gpu.memory_gib * gpu_memory_utilization * t
        return available - _overhead_gib(arch, t, activation_gib, non_torch_gib, lora_reserve_gib)

    if budget(tp) <= 0:
        minimum = next((t for t in range(tp + 1, 1025) if budget(t) > 0), None)
        hint = f"use tp >= {minimum}" if minimum else "use a GPU with more memory"
        raise ConfigError(
            f"model {name!r} on {gpu.name} at tp {tp}: weights and overheads "
            f"({_overhead_gib(arch, tp, activation_gib, non_torch_gib, lora_reserve_gib):.2f} GiB) "
            f"do not fit in {gpu.memory_gib * gpu_memory_utilization * tp:.2f} GiB; {hint}"
        )
    block_bytes = kv_block_bytes(arch, tp, block_size)
    if block_bytes <= 0:
        raise ConfigError(f"model {name!r}: KV bytes per block is 0; check the architecture")
    blocks = int(budget(tp) * GIB) // block_bytes
    if arch.is_moe and dp > 1:
        blocks *= dp
    return blocks


def auto_max_model_len(arch: ModelArch, total_blocks: int, block_size: int = 16) -> int:
    """``max_position_embeddings`` × rope factor (not for su/longrope/llama3; yarn scales
    ``original_max_position_embeddings``; gemma3 unscaled), capped at blocks × block_size."""
    length = arch.max_position_embeddings
    rope = arch.rope_scaling_type.lower()
    factor = arch.rope_scaling_factor
    if rope and rope not in _UNSCALED_ROPE_TYPES and factor > 0 and arch.model_type != "gemma3":
        base = length
        if rope == "yarn" and arch.rope_original_max_position_embeddings > 0:
            base = arch.rope_original_max_position_embeddings
        length = int(base * factor)
    cap = total_blocks * block_size
    return min(length, cap) if length > 0 else cap
