"""Cluster code that is not the run's: the checks of the committed cluster specs
(`launcher_spec` for Ray's cluster launcher, `kuberay_spec` for KubeRay, `spec` what both
share) and the spot agent that turns a provider's reclaim notice into a Ray drain (`spot`,
`python -m rayacc.cluster.spot`)."""
