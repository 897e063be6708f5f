"""``freescale prepare`` (DuckDB, in process, memory-bounded) against what a user would write instead.

One synthetic MovieLens-shaped log (``freescale gen-log``'s generator, Parquet,
rows shuffled) goes through the same job in each variant: drop items seen fewer
than 2 times, then users with fewer than 5 interactions, dense ids (items by
frequency), one time-ordered sequence per user, Parquet out.  Each variant runs
in its own process, so its peak memory (``VmHWM``) is its own.

    freescale        freescale.dataloader.prepare (DuckDB), --memory 4GB
    freescale-512MB  the same under a 512 MB engine bound (it spills)
    pandas           read_parquet, value_counts filters, sort_values, groupby().agg(list)
    polars           the lazy equivalent (the engine we did not choose), collect(streaming)

    python benchmarks/bench_prepare.py [--quick] [--full] [--json PATH]

``--quick``: 1M interactions; default 10M; ``--full``: also 100M, freescale's variants only (pandas
and polars hold the whole log in memory: 2.7 and 1.5 GB at 10M, past this machine's 24 GB at 100M).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json  # noqa: E402

from freescale.tables import print_table  # noqa: E402

MIN_ITEM, MIN_USER = 2, 5
VARIANTS = ("freescale", "freescale-512MB", "pandas", "polars")


def make_log(path: Path, interactions: int) -> int:
    import pyarrow.parquet as pq

    from freescale.dataloader.synthetic_log import LogSpec, interactions as generate

    users = max(interactions // 181, 10)  # ml-1m's fit: about 181 interactions per user
    table = generate(LogSpec(users=users, items=max(users // 2, 100), min_per_user=1, seed=0))
    pq.write_table(table, path, row_group_size=1 << 20)
    return table.num_rows


def run_freescale(log: Path, out: Path, memory: str) -> dict[str, int]:
    from freescale.dataloader.log_input import LogColumns
    from freescale.dataloader.prepare import PrepareSpec, prepare

    cols = LogColumns(user="userId", item="movieId", time="timestamp", label="rating", rating_threshold=4.0)
    report = prepare(PrepareSpec(input=str(log), out=str(out), columns=cols, memory=memory,
                                 min_item_count=MIN_ITEM, min_user_count=MIN_USER))
    return {"users": report.users, "interactions": report.interactions_kept}


def run_pandas(log: Path, out: Path) -> dict[str, int]:
    import pandas as pd

    df = pd.read_parquet(log)
    df = df[df["movieId"].map(df["movieId"].value_counts()) >= MIN_ITEM]
    df = df[df["userId"].map(df["userId"].value_counts()) >= MIN_USER]
    items = df["movieId"].value_counts()
    df["item_id"] = df["movieId"].map(pd.Series(range(len(items)), index=items.index))
    df["user_id"] = df["userId"].astype("category").cat.codes
    df["label"] = (df["rating"] >= 4).astype("float32")
    df = df.sort_values(["user_id", "timestamp", "item_id"])
    users = df.groupby("user_id", sort=True).agg(
        item_ids=("item_id", list), timestamps=("timestamp", list), labels=("label", list))
    users.to_parquet(out / "users.parquet")
    return {"users": len(users), "interactions": len(df)}


def run_polars(log: Path, out: Path) -> dict[str, int]:
    import polars as pl

    lf = pl.scan_parquet(log)
    lf = lf.filter(pl.len().over("movieId") >= MIN_ITEM).filter(pl.len().over("userId") >= MIN_USER)
    df = lf.collect()
    counts = df.group_by("movieId").len().sort(["len", "movieId"], descending=[True, False])
    vocab = counts.with_row_index("item_id").select("movieId", pl.col("item_id").cast(pl.Int64))
    users = (
        df.join(vocab, on="movieId")
        .with_columns(user_id=pl.col("userId").rank("dense").cast(pl.Int64) - 1,
                      label=(pl.col("rating") >= 4).cast(pl.Float32))
        .sort(["user_id", "timestamp", "item_id"])
        .group_by("user_id", maintain_order=True)
        .agg(item_ids=pl.col("item_id"), timestamps=pl.col("timestamp"), labels=pl.col("label"))
    )
    users.write_parquet(out / "users.parquet")
    return {"users": users.height, "interactions": int(users["item_ids"].list.len().sum())}


def peak_rss_mb() -> float:
    """This process's peak resident memory (``VmHWM``: per address space, so it starts afresh at exec;
    ``ru_maxrss`` would carry the parent's resident size at fork, the generated log's 10 GB at 100M)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux: an upper bound


def child(variant: str, log: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if variant.startswith("freescale"):
        done = run_freescale(log, out, "512MB" if variant.endswith("512MB") else "4GB")
    else:
        done = run_pandas(log, out) if variant == "pandas" else run_polars(log, out)
    wall = time.perf_counter() - start
    peak_mb = peak_rss_mb()
    print(json.dumps({"variant": variant, "wall_s": wall, "peak_mb": peak_mb, **done}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--full", action="store_true", help="also 100M interactions")
    parser.add_argument("--json")
    parser.add_argument("--child", nargs=3, metavar=("VARIANT", "LOG", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), Path(args.child[2]))
        return
    sizes = [1_000_000] if args.quick else [10_000_000] + ([100_000_000] if args.full else [])
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        for size in sizes:
            log = Path(tmp) / f"log-{size}.parquet"
            n = make_log(log, size)
            for variant in VARIANTS if size <= 10_000_000 else VARIANTS[:2]:
                proc = subprocess.run([sys.executable, __file__, "--child", variant, str(log), f"{tmp}/{variant}-{size}"],
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    rows.append({"log_rows": n, "variant": variant, "error": proc.stderr.strip().splitlines()[-1]})
                    continue
                result = json.loads(proc.stdout.strip().splitlines()[-1])
                rows.append({"log_rows": n, **result, "rows_per_s": n / result["wall_s"]})
    base = {r["log_rows"]: r["wall_s"] for r in rows if r.get("variant") == "freescale" and "wall_s" in r}
    for r in rows:
        if "wall_s" in r:
            r["time_vs_freescale"] = r["wall_s"] / base[r["log_rows"]]
    print_table(rows, ["log_rows", "variant", "wall_s", "rows_per_s", "peak_mb", "users", "interactions",
                       "time_vs_freescale", "error"])
    if args.json:
        write_json(args.json, "bench_prepare", {"sizes": sizes, "min_item": MIN_ITEM, "min_user": MIN_USER}, rows)


if __name__ == "__main__":
    main()
