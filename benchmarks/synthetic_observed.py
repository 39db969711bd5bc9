"""Write `configs/observed/synthetic-small.json`: a small observed file (the format of
`../shared/reference/observed/trainval15.json`) whose "observations" are blis-jax's own
simulations at known coefficients, so that `blis-jax fit` can be tried, and checked, in a
couple of minutes without real measurements.

The truth is the iter29 coefficients (`fits/trained-physics-iter29.yaml`) with α₀ halved and b3
(weight loading) raised by 25 %; a fit from iter29 with `--params alpha0,b3` should find them
again. Three Llama-3.1-8B experiments on one H100 at 2, 5 and 10 req/s (inference-perf shared
prefix, no multi-turn chat, ~60 requests each).

    python benchmarks/synthetic_observed.py            # rewrites configs/observed/synthetic-small.json
"""

import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import blis_jax as bj  # noqa: E402

OUT = ROOT / "configs" / "observed" / "synthetic-small.json"
MODEL, HARDWARE, TP = "meta-llama/llama-3.1-8b-instruct", "H100", 1
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, TOTAL_KV_BLOCKS = 64, 2048, 20000
RATES_AND_DURATIONS = ((2.0, 30), (5.0, 12), (10.0, 6))   # ~60 requests each


def truth() -> tuple[list[float], list[float]]:
    start = yaml.safe_load((ROOT / "fits" / "trained-physics-iter29.yaml").read_text())
    alpha, beta = list(start["alpha"]), list(start["beta"])
    alpha[0] *= 0.5       # alpha0: queueing
    beta[2] *= 1.25       # b3: weight loading
    return alpha, beta


def workload(rate: float, duration: int) -> dict:
    return {"version": "2", "seed": 42, "num_requests": int(rate * duration),
            "inference_perf": {"shared_prefix": {"enable_multi_turn_chat": False, "num_unique_system_prompts": 2,
                                                 "num_users_per_system_prompt": 2, "system_prompt_len": 64,
                                                 "question_len": 256, "output_len": 64},
                               "stages": [{"rate": rate, "duration": duration}]}}


def main() -> None:
    alpha, beta = truth()
    experiments = []
    for i, (rate, duration) in enumerate(RATES_AND_DURATIONS):
        spec = workload(rate, duration)
        config = bj.ScenarioConfig(
            deployment=bj.Deployment(model=MODEL, hardware=HARDWARE, tp=TP, alpha=tuple(alpha), beta=tuple(beta),
                                     total_kv_blocks=TOTAL_KV_BLOCKS),
            engine=bj.EngineSettings(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS),
            workload=bj.SpecWorkload(spec=spec))
        m = bj.simulate(config).metrics
        experiments.append({
            "id": f"synthetic-{i + 1}",
            "run_name": f"synthetic-llama-3.1-8b-rate-{rate:g}",
            "config": {"id": f"synthetic-{i + 1}", "model": MODEL, "hardware": HARDWARE, "tp": TP,
                       "max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                       "total_kv_blocks": TOTAL_KV_BLOCKS, "cpu_kv_blocks": 0, "workload": spec,
                       "num_requests": spec["num_requests"]},
            "observed": {"ttft_mean_ms": m["ttft_mean_ms"], "e2e_mean_ms": m["e2e_mean_ms"],
                         "itl_mean_ms": m["itl_mean_ms"], "completed": m["completed_requests"]},
            "observed_source": "blis-jax simulation at the truth coefficients (benchmarks/synthetic_observed.py)",
        })
        print(f"{experiments[-1]['id']}: {m['completed_requests']} requests, TTFT {m['ttft_mean_ms']:.3f} ms, "
              f"E2E {m['e2e_mean_ms']:.3f} ms", file=sys.stderr)
    doc = {"description": "Synthetic observations for trying `blis-jax fit`: blis-jax's own simulations of three "
                          "small Llama-3.1-8B / H100 experiments at known coefficients (not real measurements).",
           "truth": {"alpha": alpha, "beta": beta,
                     "from": "fits/trained-physics-iter29.yaml with alpha0 x 0.5 and b3 (beta[2]) x 1.25"},
           "generated_by": "python benchmarks/synthetic_observed.py",
           "experiments": experiments}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
