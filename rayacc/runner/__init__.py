"""The Ray layer: Ray Data ingestion in the global-sample order, the per-worker training loop,
and the TorchTrainer launch."""
