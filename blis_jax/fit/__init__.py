"""Fitting latency coefficients to observed measurements (`blis-jax fit`).

* `schedule`: a simulation's step trace and the chained fixed-schedule latencies;
* `local`: request-local fixed-schedule latencies (the fitting default);
* `observed`: the observed experiments file and BLIS's loss;
* `fit`: the outer (simulate) / inner (adam) fitting driver and cross-validation;
* `report`, `commands`: the coefficient YAML, the report directory and the CLI subcommand;
* `sensitivity`, `sensitivity_commands`: derivatives of a run's metrics (`blis-jax sensitivity`).
"""
