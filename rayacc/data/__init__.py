"""Datasets: bundled corpora prepared as Parquet, user Parquet sources, and the global-sample data
order that every rank follows."""

from rayacc.data.bundled import prepare_bundled
from rayacc.data.common import BUNDLED, DataError
from rayacc.data.sources import DatasetInfo, describe_dataset

__all__ = ["BUNDLED", "DataError", "DatasetInfo", "describe_dataset", "prepare_bundled"]
