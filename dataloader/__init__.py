"""Sequence-sample data: schema, synthetic generator, and the cost-balanced loader.

Reading order: ``schema`` (columns, manifest, errors) -> ``synthetic`` (gen-data)
-> ``cost`` (per-sample cost model) -> ``partition`` (split a batch by cost)
-> ``planner`` (which rows each live rank takes at each step) -> ``source``
(row-group Parquet reads, validation) -> ``loader`` (``BalancedLoader``,
prefetch, state) -> ``batch``.
"""

from freescale.dataloader.schema import DataError, DatasetManifest, sample_schema
from freescale.dataloader.synthetic import SyntheticSpec, generate

__all__ = ["DataError", "DatasetManifest", "SyntheticSpec", "generate", "sample_schema"]
