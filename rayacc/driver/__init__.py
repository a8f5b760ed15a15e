"""What runs on the driver: the checks before launch (`prelaunch`, `places`), the run's
location (`runs`), the TorchTrainer launch and the relay of what the ranks report (`fit`),
`verify`, sweeps through Ray Tune (`sweep`), job submission (`jobs`), `sample`, and the
planner's measuring part on a real worker group (`calibrate`). It imports the worker side
(what it launches); the worker side never imports it."""
