"""The wrapper form (``ft.wrap``) vs the explicit 4-call form (``FaultTolerance``) on the same model: step time.

Both forms train ``examples/deepfm_ft.py``'s DeepFM (four tables, one multi-hot; fused row-wise
Adagrad + Adam, a warm-up scheduler) on the same samples, as 2 replica groups of ``--ranks`` ranks
under ``freescale launch -- python ...`` (a lighthouse, one elastic agent per group), CPU and gloo,
one compute thread per rank.  The explicit form is written as a user would write it with
``FaultTolerance`` and the same ``StepSamples`` (the layer scales the loss from it either way).
The wrapper adds a forward hook (a gradient hook on the model's output) and a generator around the
same calls, so the target is "within noise".

Timed: each group's rank 0 records ``time.perf_counter()`` at every committed step; a run's step
time is the median gap after ``--warmup`` steps (group 0).  Runs alternate (explicit, wrapper,
wrapper, explicit, ...) ``--repeats`` times; the ratio is the median of the paired ratios (a pair
shares this VM's drift), and every run's value is in the JSON.

    python benchmarks/bench_ft_wrapper.py [--quick] [--steps 200] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def worker(args: argparse.Namespace) -> None:
    """One rank of one group (run by the launcher): ``args.steps`` steps in ``args.form``."""
    import torch
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torch import nn
    from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter

    sys.path.insert(0, str(REPO / "examples"))
    from deepfm_ft import DeepFM, features

    import freescale.ft as ft

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = ft.shard(DeepFM(), torch.device("cpu"),
                     fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05})
    dense = KeyedOptimizerWrapper(dict(in_backward_optimizer_filter(model.named_parameters())),
                                  lambda params: torch.optim.Adam(params, lr=1e-2))
    optimizer = CombinedOptimizer([model.fused_optimizer, dense])
    scheduler = torch.optim.lr_scheduler.LambdaLR(dense, lambda step: min(1.0, (step + 1) / 20))
    samples = ft.StepSamples(per_step=args.batch * dist.get_world_size() * int(os.environ["FREESCALE_REPLICAS"]))
    times: list[float] = []
    if args.form == "wrapper":
        wrapped = ft.wrap(model, optimizer, data=samples, scheduler=scheduler)
        for step in wrapped.steps(args.steps):
            kjt, labels = features(samples.mine(step))
            wrapped.zero_grad()
            nn.functional.binary_cross_entropy_with_logits(model(kjt), labels).backward()
            wrapped.step()
            times.append(time.perf_counter())
    else:
        layer = ft.FaultTolerance(model, optimizer, ft.FTConfig.from_env(), data=samples, scheduler=scheduler)
        layer.start()
        step = 0
        while step < args.steps:
            layer.begin_step(step)
            if layer.can_train(step):
                kjt, labels = features(samples.mine(step))
                layer.backward(nn.functional.binary_cross_entropy_with_logits(model(kjt), labels))
            step = layer.step().step + 1
            times.append(time.perf_counter())
        layer.finish(args.steps - 1)
        layer.close()
    if dist.get_rank() == 0:
        group = os.environ.get("FREESCALE_REPLICA_INDEX", "0")
        Path(args.out, f"times{group}.json").write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def run(form: str, args: argparse.Namespace, out: Path) -> float:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "freescale.cli", "launch", "--replicas", "2", "--ranks-per-replica", str(args.ranks),
           "--", sys.executable, __file__, "--worker", "--form", form, "--steps", str(args.steps), "--batch",
           str(args.batch), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"bench_ft_wrapper: the {form} run failed:\n{proc.stderr[-3000:]}")
    times = json.loads((out / "times0.json").read_text())[args.warmup:]
    return 1e3 * statistics.median(b - a for a, b in zip(times, times[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one pair, 60 steps (under a minute)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs")
    parser.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    parser.add_argument("--ranks", type=int, default=1, help="ranks per replica group")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--form", choices=["explicit", "wrapper"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 60, 10
    sys.path.insert(0, str(REPO / "benchmarks"))
    from common import write_json

    from freescale.tables import print_table

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="freescale-wrapper-") as tmp:
        for pair in range(args.repeats):
            order = ("explicit", "wrapper") if pair % 2 == 0 else ("wrapper", "explicit")
            ms = {form: run(form, args, Path(tmp) / f"{pair}-{form}") for form in order}
            rows.append({"pair": pair, "explicit_ms": round(ms["explicit"], 3), "wrapper_ms": round(ms["wrapper"], 3),
                         "ratio": round(ms["wrapper"] / ms["explicit"], 4)})
    summary = {"pair": "median", "explicit_ms": round(statistics.median(r["explicit_ms"] for r in rows), 3),
               "wrapper_ms": round(statistics.median(r["wrapper_ms"] for r in rows), 3),
               "ratio": round(statistics.median(r["ratio"] for r in rows), 4)}
    print_table(rows + [summary], ["pair", "explicit_ms", "wrapper_ms", "ratio"])
    if args.json:
        write_json(args.json, "ft_wrapper", {k: v for k, v in vars(args).items() if k not in ("worker", "form", "out")},
                   rows + [summary])


if __name__ == "__main__":
    main()
