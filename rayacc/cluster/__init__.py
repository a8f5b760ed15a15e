"""Cluster code that is not the run's: the check of a cluster spec (`spec`) and the spot
agent that turns a provider's reclaim notice into a Ray drain (`spot`, `python -m
rayacc.cluster.spot`)."""
