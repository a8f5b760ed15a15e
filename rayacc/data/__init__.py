"""Datasets: bundled corpora prepared as Parquet, user Parquet sources, and the global-sample data
order that every rank follows."""

from rayacc.data.sources import BUNDLED, DataError, DatasetInfo, describe_dataset, prepare_bundled

__all__ = ["BUNDLED", "DataError", "DatasetInfo", "describe_dataset", "prepare_bundled"]
