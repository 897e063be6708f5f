"""Sequence-sample data: schema, synthetic generator, and the cost-balanced loader.

Reading order: ``schema`` (both layouts, manifest, errors) -> ``prepare`` (a log in:
``log_input``, ``prepare_sql``, ``sequence_writer``) -> ``synthetic`` (gen-data)
-> ``cost`` (per-sample cost model) -> ``partition`` (split a batch by cost)
-> ``planner`` (which rows each live rank takes at each step) -> ``source``
(row-group Parquet reads; ``sequence_source`` for format 2; ``row_checks``) -> ``loader`` (``BalancedLoader``,
prefetch, state; ``build`` makes it from ``[data]``) -> ``batch``.
"""

if __name__ != "freescale.dataloader":  # imported by its folder name, the repository root on sys.path
    raise ImportError(f"import freescale.dataloader, not {__name__}: dataloader/ is the package freescale.dataloader, and a "
                      "second name would load its modules twice (duplicate registries, classes that differ)")

from freescale.dataloader.schema import DataError, DatasetManifest, sample_schema
from freescale.dataloader.synthetic import SyntheticSpec, generate

__all__ = ["DataError", "DatasetManifest", "SyntheticSpec", "generate", "sample_schema"]
