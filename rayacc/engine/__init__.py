"""Pure-PyTorch training engine: batch split, LR rules, the accumulation step, gradient-sync
control and train state. Imports torch only (never ray or mlflow), so it runs under plain
torch.distributed as well as inside Ray Train workers."""

from rayacc.config.batch_split import BatchSplit, BatchSplitError, resolve_batch_split
from rayacc.engine.autobatch import MicroBatchSearch, TrialOutOfMemory, find_micro_batch_size
from rayacc.engine.chunked_loss import chunked_cross_entropy_sum
from rayacc.engine.collectives import all_gather_objects, all_reduce, group_device
from rayacc.engine.losses import (
    IGNORE_INDEX,
    classification_item_losses,
    collate_tokens,
    count_rows,
    count_target_tokens,
    to_device,
    token_item_losses,
)
from rayacc.engine.lr import LR_RULES, SampleSchedule, build_scheduler, effective_lr, lr_multiplier
from rayacc.engine.parallel import DDP, FSDP, ModelRecipe, Strategy, make_strategy, strategy_of
from rayacc.engine.perf import (
    StepClock,
    StepCost,
    device_peak_tflops,
    flops_per_item,
    recompute_flops_per_item,
)
from rayacc.engine.precision import autocast, autocast_dtype
from rayacc.engine.result import StepResult
from rayacc.engine.step import PRECISIONS, AccumulationStep, MicroStepMismatchError
from rayacc.engine.sync import CommCounter, install_comm_counter
from rayacc.engine.train_state import TrainState

__all__ = [
    "DDP",
    "FSDP",
    "IGNORE_INDEX",
    "LR_RULES",
    "PRECISIONS",
    "AccumulationStep",
    "BatchSplit",
    "BatchSplitError",
    "CommCounter",
    "MicroBatchSearch",
    "MicroStepMismatchError",
    "ModelRecipe",
    "SampleSchedule",
    "StepClock",
    "StepCost",
    "StepResult",
    "Strategy",
    "TrainState",
    "TrialOutOfMemory",
    "all_gather_objects",
    "all_reduce",
    "autocast",
    "autocast_dtype",
    "build_scheduler",
    "chunked_cross_entropy_sum",
    "classification_item_losses",
    "collate_tokens",
    "count_rows",
    "count_target_tokens",
    "device_peak_tflops",
    "effective_lr",
    "find_micro_batch_size",
    "flops_per_item",
    "group_device",
    "install_comm_counter",
    "lr_multiplier",
    "make_strategy",
    "recompute_flops_per_item",
    "resolve_batch_split",
    "strategy_of",
    "to_device",
    "token_item_losses",
]
