"""Named workload presets (`blis run --workload chatbot|contentgen|summarization|multidoc`).

Same synthesis as the distribution workload (constant arrivals at `--rate`, clamped Gaussian
lengths); only the length figures differ. Figures per spec §4.2 (BLIS `defaults.yaml`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from blis_jax.errors import ConfigError
from blis_jax.workload.distribution import (
    DEFAULT_TIMEOUT_S,
    DistributionWorkload,
    GaussianLength,
    generate_distribution,
)
from blis_jax.workload.requests import RequestSet


@dataclasses.dataclass(frozen=True)
class Preset:
    prompt: GaussianLength
    output: GaussianLength
    prefix_tokens: int = 0


PRESETS: Mapping[str, Preset] = MappingProxyType({
    "chatbot": Preset(prompt=GaussianLength(256, 100, 2, 800), output=GaussianLength(256, 100, 1, 1024)),
    "contentgen": Preset(prompt=GaussianLength(1024, 150, 10, 2048), output=GaussianLength(1024, 200, 10, 2048)),
    "summarization": Preset(prompt=GaussianLength(4096, 500, 100, 8192), output=GaussianLength(512, 150, 10, 2048)),
    "multidoc": Preset(prompt=GaussianLength(10240, 1200, 500, 20480), output=GaussianLength(1536, 300, 50, 4096)),
})


def preset_workload(name: str, *, rate: float = 1.0, num_requests: int = 100,
                    timeout_s: float = DEFAULT_TIMEOUT_S, horizon_us: int | None = None) -> DistributionWorkload:
    """The DistributionWorkload of preset `name` at `rate` req/s."""
    preset = PRESETS.get(name)
    if preset is None:
        raise ConfigError(f"--workload: unknown preset {name!r}; choose distribution or one of "
                          f"{', '.join(PRESETS)}")
    return DistributionWorkload(rate=rate, num_requests=num_requests, prompt=preset.prompt,
                                output=preset.output, prefix_tokens=preset.prefix_tokens,
                                timeout_s=timeout_s, horizon_us=horizon_us)


def generate_preset(name: str, seed: int, **kwargs) -> RequestSet:
    """Convenience: `generate_distribution(preset_workload(name, **kwargs), seed)`."""
    return generate_distribution(preset_workload(name, **kwargs), seed)
