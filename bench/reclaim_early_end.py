"""How soon a group drained for preemption restarts without the node once its work is saved:
at the drain's deadline (what Ray Train does) or at once (`end_group_now`, what rank 0 calls
after the last checkpoint before a reclaim). On a real local cluster (cluster/local.sh: a head
and one worker node), a 2-worker elastic Ray Train group idles; its worker node is drained for
preemption with a deadline --deadline-s away, and --saved-s later the work counts as saved:
once doing nothing (the deadline ends the group), once calling `end_group_now`. Prints, for
each, the seconds from the drain to the next (1-worker) group's start, and whether Ray Train
counted it as a preemption (the run has max_failures=0: a failure would end it).

    .venv/bin/python bench/reclaim_early_end.py [--deadline-s 60] [--saved-s 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from spot_goodput import local  # noqa: E402 (cluster/local.sh from this checkout)

PORT = "29679"


def train_fn(config: dict) -> None:
    import ray.train

    ctx = ray.train.get_context()
    if ctx.get_world_rank() == 0:
        with open(config["log"], "a") as f:
            f.write(f"{time.time()} {ctx.get_world_size()}\n")
    if ctx.get_world_size() == 1:
        return  # the group without the drained node: done
    time.sleep(600)  # the 2-worker group idles until Ray Train ends it


def one_run(early: bool, deadline_s: float, saved_s: float) -> tuple[float, float | None]:
    """(seconds from the drain to the 1-worker group's start, to the end_group_now call)."""
    import ray
    from ray.core.generated import autoscaler_pb2
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from rayacc.worker.preemption import end_group_now

    folder = Path(tempfile.mkdtemp(prefix="rayacc-early-"))
    log = folder / "starts.txt"
    log.touch()
    marks: dict[str, float] = {}

    def reclaim() -> None:
        while len(log.read_text().splitlines()) < 1:  # the 2-worker group runs
            time.sleep(0.2)
        node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("node_1"))
        gcs = ray._private.worker.global_worker.gcs_client
        reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
        marks["drain"] = time.time()
        gcs.drain_node(node, reason, "spot reclaim", int((marks["drain"] + deadline_s) * 1000))
        if early:
            time.sleep(saved_s)
            marks["end_group_now"] = time.time()
            end_group_now([node])

    thread = threading.Thread(target=reclaim, daemon=True)
    thread.start()
    TorchTrainer(
        train_fn,
        train_loop_config={"log": str(log)},
        scaling_config=ScalingConfig(
            num_workers=(1, 2), resources_per_worker={"CPU": 0.5, "worker_slot": 1}
        ),
        run_config=RunConfig(
            storage_path=str(folder), name="early", failure_config=FailureConfig(max_failures=0)
        ),
    ).fit()
    starts = [float(line.split()[0]) for line in log.read_text().splitlines()]
    ended = marks.get("end_group_now")
    return starts[-1] - marks["drain"], None if ended is None else ended - marks["drain"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--deadline-s", type=float, default=60)
    parser.add_argument("--saved-s", type=float, default=5)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="rayacc-early-cluster-"))
    env = dict(
        os.environ,
        RAYACC_LOCAL_DIR=str(folder),
        RAYACC_LOCAL_PORT=PORT,
        RAYACC_LOCAL_MLFLOW="0",
        # an elastic run's placement timeout, as rayacc sets it (scaling.start_timeout_s)
        RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="10",
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    env.pop("RAY_ADDRESS", None)
    results = {}
    for early in (False, True):
        local(env, "up", "1")
        try:
            gcs = dict(
                line.removeprefix("export ").split("=", 1)
                for line in (folder / "env").read_text().splitlines()
            )["RAYACC_GCS_ADDRESS"]
            one = [str(early), str(args.deadline_s), str(args.saved_s)]
            proc = subprocess.run(
                [sys.executable, __file__, "--one", *one],
                env=dict(env, RAY_ADDRESS=gcs, RAY_AUTH_MODE="token"),
                capture_output=True,
                text=True,
                timeout=args.deadline_s + 300,
            )
            if proc.returncode != 0:
                raise SystemExit(proc.stdout[-3000:] + proc.stderr[-3000:])
            results[early] = [float(v) for v in proc.stdout.split()[-2:]]
        finally:
            local(env, "down")
    print(
        f"a 2-worker elastic group, its worker node drained with a {args.deadline_s:g} s "
        f"deadline; the work saved {args.saved_s:g} s after the drain"
    )
    for early, (restart, _) in results.items():
        how = "end_group_now at the save" if early else "waiting for the deadline"
        print(f"{how:28} next group {restart:6.1f} s after the drain")
    print(
        f"seconds saved: {results[False][0] - results[True][0]:.1f} "
        f"(a preemption to Ray Train both times: the runs have max_failures=0)"
    )


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--one":
        import ray

        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        restart, ended = one_run(sys.argv[2] == "True", float(sys.argv[3]), float(sys.argv[4]))
        print(restart, -1.0 if ended is None else ended)
    else:
        main()
