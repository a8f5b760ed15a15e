"""What runs on a rank of the worker group: the loop (`loop.train_loop`, Ray Train's
`train_loop_per_worker`), the reader of the rank's rows (`ingest`), the auto micro-batch
(`autosize`), validation, the step's record (`metrics`), preemption notices, the outbox to the
driver (`progress`) and checkpoints (`checkpoint`, also read back by the driver and
`load_model`). Nothing here imports the driver side."""
