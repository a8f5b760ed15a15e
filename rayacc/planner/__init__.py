"""`rayacc plan --search`: the settings that only change speed and memory (workers,
micro-batch with accumulation derived, strategy, activation checkpointing), chosen at the job's
global batch, so every candidate computes the same step.

- `candidates`: what may run (and why the rest may not);
- `prior`: memory per rank and step time of a candidate from a measured profile (pure);
- `profile`: the profile, measured on the worker group's own devices (pure torch);
- `calibrate`: the profile and a few steps of the best candidates on the real worker group
  (Ray), out-of-memory probed rank-safely;
- `planfile`: PLAN.yaml, written and read back into a config;
- `search`: the whole search, its table and the choice.
"""
