"""Sequence-sample data: schema, synthetic generator, reader producing ``Batch`` es.

Reading order: ``schema`` (columns, manifest, errors) -> ``synthetic`` (gen-data)
-> ``reader`` (Parquet to ``Batch``) -> ``batch``.
"""

from freescale.dataloader.schema import DataError, DatasetManifest, sample_schema
from freescale.dataloader.synthetic import SyntheticSpec, generate

__all__ = ["DataError", "DatasetManifest", "SyntheticSpec", "generate", "sample_schema"]
