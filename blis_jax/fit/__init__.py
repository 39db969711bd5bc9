"""Fitting latency coefficients to observed measurements (`blis-jax fit`).

* `schedule`: a simulation's step trace and the chained fixed-schedule latencies;
* `local`: request-local fixed-schedule latencies (the fitting default);
* `observed`: the observed experiments file and BLIS's loss;
* `fit`: the outer (simulate) / inner (adam) fitting driver and cross-validation;
* `report`: the coefficient YAML and the report directory;
* `real_traces`: real request traces replayed and scored, and as fit observations;
* `sensitivity`: derivatives of a run's metrics (`blis-jax sensitivity`).

The subcommands' flags and output are in `blis_jax/cli/fit.py` and `blis_jax/cli/sensitivity.py`.
"""
