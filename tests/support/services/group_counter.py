"""The Ray Train callback that counts worker-group starts (tests/support/services/counts.py);
a module of its own so that a suite that starts no group never imports Ray for it."""

from __future__ import annotations

import os

from ray.train.v2._internal.execution.callback import WorkerGroupCallback

from tests.support.services.counts import COUNTS_ENV, count


class CountWorkerGroups(WorkerGroupCallback):
    """Built where the trainer is (a test process, a `rayacc` it started, a Tune trial), so it
    carries that process's counts file into Ray Train's controller, where the group starts."""

    def __init__(self) -> None:
        self.path = os.environ.get(COUNTS_ENV)

    def after_worker_group_start(self, worker_group) -> None:
        count("worker groups", self.path)
