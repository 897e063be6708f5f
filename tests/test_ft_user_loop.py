"""The pieces a user's own loop uses (``freescale.ft``): ``StepSamples``, the snapshot's extra state,
``FTConfig.from_env``, ``ft.shard``'s constraints, and ``freescale launch -- COMMAND``'s refusals.

The whole wrapper form runs with a real SIGKILL in ``tests/test_examples.py`` (``examples/deepfm_ft.py``).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from freescale.cli import main
from freescale.config import ConfigError
from freescale.ft import FTConfig, StepSamples
from freescale.ft.snapshot_state import from_json, rng_state, set_rng_state, to_json
from freescale.step_types import Commit


def _group(samples_of_group: dict[int, StepSamples]) -> None:
    for group, samples in samples_of_group.items():
        samples.bind(group, len(samples_of_group), rank=0, ranks=1)


def test_step_samples_split_over_ready_groups_and_requeue_a_dead_groups_share() -> None:
    groups = {g: StepSamples(per_step=12) for g in range(3)}
    _group(groups)
    plans = [s.plan(0) for s in groups.values()]
    assert plans[0] == plans[1] == plans[2]
    assert sorted(i for ids in plans[0].values() for i in ids) == list(range(12))
    assert [len(groups[g].mine(0)) for g in range(3)] == [4, 4, 4]
    # step 0 commits without group 2's gradients (it died), group 2 not ready any more
    for s in groups.values():
        s.commit(Commit(0, frozenset({0, 1}), frozenset({0, 1})))
    carried = plans[0][2]
    assert groups[0].carry == carried and sorted(groups[0].last_trained) == sorted(plans[0][0] + plans[0][1])
    step1 = groups[0].plan(1)
    assert set(step1) == {0, 1} and groups[1].plan(1) == step1
    assert sorted(i for ids in step1.values() for i in ids) == sorted(carried + list(range(12, 24)))
    assert groups[0].weight(1) == 8 and groups[2].weight(1) == 0 and len(groups[2].mine(1)) == 0
    # a recovering group loads the state from a peer's snapshot and plans alike
    late = StepSamples(per_step=12)
    late.bind(2, 3, rank=0, ranks=1)
    late.load_state_dict(groups[0].state_dict())
    assert late.plan(1) == step1
    # join = "wait": step 1's vote names group 2 as joining, so step 2 is planned over it too (in the snapshot it
    # loads as well); it does not make it in, so its share of step 2 is requeued at that commit
    for s in groups.values():
        s.commit(Commit(1, frozenset({0, 1}), frozenset({0, 1}), joining=frozenset({2})))
    late.load_state_dict(groups[0].state_dict())
    step2 = late.plan(2)
    assert set(step2) == {0, 1, 2} and groups[0].plan(2) == step2 and late.weight(2) == 4
    for s in groups.values():
        s.commit(Commit(2, frozenset({0, 1}), frozenset({0, 1})))
    assert groups[0].carry == step2[2] and set(groups[0].plan(3)) == {0, 1}


def test_step_samples_split_a_groups_share_over_its_ranks_and_scale_the_mean() -> None:
    ranks = [StepSamples(per_step=10) for _ in range(2)]
    for r, s in enumerate(ranks):
        s.bind(0, 1, rank=r, ranks=2)
    assert sorted(ranks[0].mine(0).tolist() + ranks[1].mine(0).tolist()) == list(range(10))
    assert ranks[0].weight(0) == 10 and ranks[0].rank_samples(0) + ranks[1].rank_samples(0) == 10
    with pytest.raises(ValueError, match="per_step=3 is fewer than the 2 x 2 ranks"):
        StepSamples(per_step=3).bind(0, 2, 0, 2)


def test_a_data_side_of_ones_own_needs_only_commit_and_its_state() -> None:
    """A loop's own data side with just ``commit``, ``state_dict`` and ``load_state_dict`` (its ``commit`` returning
    whatever it likes) is taken as it is: the optional methods answer None; one lacking a required method is one
    line naming it; the wrapper form asks for ``weight`` and ``rank_samples`` too."""
    from freescale.step_types import Accounted, DataSide

    class Minimal:
        def commit(self, commit: Commit) -> list[int]:
            return [commit.step]

        def state_dict(self) -> dict[str, int]:
            return {}

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    side = DataSide(Minimal(), "test")
    side.bind(0, 2, 0, 1)  # absent: nothing to do
    assert side.weight(0) is None and side.rank_samples(0) is None and not side.weighs
    assert side.commit(Commit(0, frozenset({0}), frozenset({0}))) is None  # not an Accounted: ignored
    samples = DataSide(StepSamples(per_step=4), "test")
    samples.bind(0, 2, 0, 1)
    assert samples.weighs and samples.weight(0) == 2.0 and samples.rank_samples(0) == 2
    accounted = samples.commit(Commit(0, frozenset({0, 1}), frozenset({0, 1})))
    assert isinstance(accounted, Accounted) and accounted.rows.tolist() == [0, 1, 2, 3] and accounted.samples == 2
    with pytest.raises(ValueError, match="data=object lacks commit, state_dict, load_state_dict"):
        DataSide(object(), "FaultTolerance")  # type: ignore[arg-type]
    from freescale.ft import wrap

    with pytest.raises(ValueError, match="must report weight"):
        wrap(torch.nn.Linear(1, 1), torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1), data=Minimal())


def test_step_samples_map_ids_onto_a_dataset_once_per_epoch() -> None:
    samples = StepSamples(per_step=4, dataset_size=10, seed=3)
    epoch0 = samples.indices(torch.arange(10))
    epoch1 = samples.indices(torch.arange(10, 20))
    assert sorted(epoch0.tolist()) == sorted(epoch1.tolist()) == list(range(10))
    assert epoch0.tolist() != epoch1.tolist()
    with pytest.raises(ValueError, match="dataset_size"):
        StepSamples(per_step=4).indices(torch.arange(3))


def test_snapshot_extras_travel_as_json_and_tensors() -> None:
    state = {"step": 7, "ema": torch.arange(4.0), "nested": {"ids": [1, 2], "t": [torch.ones(2, 2)]},
             "np": np.int64(5)}
    tensors: dict[str, torch.Tensor] = {}
    encoded = to_json(state, "/user/x", tensors)
    assert set(tensors) == {"/user/x/ema", "/user/x/nested/t/0"}
    back = from_json(encoded, tensors)
    assert back["step"] == 7 and back["np"] == 5 and back["nested"]["ids"] == [1, 2]
    assert torch.equal(back["ema"], state["ema"]) and torch.equal(back["nested"]["t"][0], torch.ones(2, 2))


def test_snapshot_rng_state_restores_every_generator() -> None:
    tensors: dict[str, torch.Tensor] = {}
    saved = rng_state(tensors)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(())))
    set_rng_state(saved, tensors)
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == expected


def test_ft_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FREESCALE_LIGHTHOUSE", "http://127.0.0.1:1")
    monkeypatch.setenv("FREESCALE_REPLICAS", "3")
    monkeypatch.setenv("FREESCALE_REPLICA_INDEX", "2")
    cfg = FTConfig.from_env(timeout_s=5.0)
    assert (cfg.lighthouse, cfg.replicas, cfg.replica_index, cfg.replica_id, cfg.timeout_s) == (
        "http://127.0.0.1:1", 3, 2, "replica2", 5.0)
    monkeypatch.setenv("FREESCALE_REPLICAS", "two")
    with pytest.raises(ConfigError, match="FREESCALE_REPLICAS='two': not an integer"):
        FTConfig.from_env()
    monkeypatch.delenv("FREESCALE_REPLICAS")
    with pytest.raises(ValueError, match="no field 'timeout'"):
        FTConfig.from_env(timeout=1)
    FTConfig(join="wait").validate()
    with pytest.raises(ConfigError, match="^join: must be one of record, wait, got 'later'"):
        FTConfig(join="later").validate()


def test_shard_constraints_force_fused_kernels_unless_a_table_asks_for_data_parallel_alone() -> None:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.planner import ParameterConstraints

    from freescale.parallelize import fused_constraints

    ebc = EmbeddingBagCollection(tables=[
        EmbeddingBagConfig(name=f"{n}_table", embedding_dim=4, num_embeddings=10, feature_names=[n])
        for n in ("a", "b")], device=torch.device("meta"))
    found = fused_constraints(ebc, {"a_table": ParameterConstraints(sharding_types=["row_wise", "data_parallel"])})
    assert found["a_table"].sharding_types == ["row_wise"] and found["a_table"].compute_kernels == ["fused"]
    assert "data_parallel" not in (found["b_table"].sharding_types or []) and found["b_table"].compute_kernels == ["fused"]
    found = fused_constraints(ebc, {"a_table": ParameterConstraints(sharding_types=["data_parallel"])})
    assert found["a_table"].sharding_types == ["data_parallel"] and found["a_table"].compute_kernels == ["dense"]
    from torchrec import EmbeddingCollection, EmbeddingConfig

    ec = EmbeddingCollection(tables=[EmbeddingConfig(name="s_table", embedding_dim=4, num_embeddings=10,
                                                     feature_names=["s"])], device=torch.device("meta"))
    with pytest.raises(ValueError, match="table 's_table' is a sequence table"):
        fused_constraints(ec, {"s_table": ParameterConstraints(sharding_types=["data_parallel"])})
    with pytest.raises(ValueError, match="table 'a_table' is data_parallel on the kernels fused"):
        fused_constraints(ebc, {"a_table": ParameterConstraints(sharding_types=["data_parallel"],
                                                                compute_kernels=["fused"])})
    with pytest.raises(ValueError, match="kernels dense; fault tolerance needs 'fused'"):
        fused_constraints(ebc, {"b_table": ParameterConstraints(compute_kernels=["dense"])})
    with pytest.raises(ValueError, match="table 'c_table', which the model does not have"):
        fused_constraints(ebc, {"c_table": ParameterConstraints()})


def test_launch_a_command_refuses_train_options_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--config", "x.toml", "--", "python", "loop.py"]) == 2
    assert "--config, --resume and config keys are for `freescale train`" in capsys.readouterr().err
    assert main(["launch", "--"]) == 2
    assert "nothing after --" in capsys.readouterr().err


def test_replica_groups_share_the_cores_between_all_their_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each group's agent sees only its own ranks, and torchrun leaves a one-rank group at every core:
    the launcher sets each rank's torch threads from every local rank of every group (a user's own
    OMP_NUM_THREADS wins).  Oversubscribed, two one-rank groups stepped 3x slower on 2 cores."""
    import subprocess

    from freescale.launch import launch_replicas, threads_per_rank

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    assert [threads_per_rank(n) for n in (1, 2, 3, 8, 16)] == ["8", "4", "2", "1", "1"]
    envs: list[dict[str, str]] = []

    class Group:  # the group agents' processes: only their environment matters here
        def __init__(self, argv: list[str], env: dict[str, str]) -> None:
            envs.append(env)

        def wait(self) -> int:
            return 0

        def poll(self) -> int:
            return 0

    monkeypatch.setattr(subprocess, "Popen", Group)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert launch_replicas(2, 1, 0, [], lighthouse_url="http://127.0.0.1:9") == 0
    assert [e["OMP_NUM_THREADS"] for e in envs] == ["4", "4"]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    envs.clear()
    assert launch_replicas(2, 2, 0, [], lighthouse_url="http://127.0.0.1:9") == 0
    assert [e["OMP_NUM_THREADS"] for e in envs] == ["3", "3"]


_REFUSED = """
import sys
import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed import DistributedModelParallel
import freescale.ft as ft

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name="small_table", embedding_dim=4, num_embeddings=10, feature_names=["f"])], device=torch.device("meta"))
        self.linear = nn.Linear(4, 1)

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
if sys.argv[1] == "unstepped table":  # a data_parallel table that no optimizer steps
    import logging, warnings
    from torchrec.distributed.planner import ParameterConstraints
    before = (list(warnings.filters), sys.excepthook, logging.getLogger("torchrec").level, logging.getLogger().filters[:])
    dmp = ft.shard(Model(), torch.device("cpu"),
                   constraints={"small_table": ParameterConstraints(sharding_types=["data_parallel"])})
    after = (list(warnings.filters), sys.excepthook, logging.getLogger("torchrec").level, logging.getLogger().filters[:])
    print("host untouched" if after == before else f"host changed: {before} -> {after}")
    params = dmp.module.linear.parameters()
else:
    dmp = DistributedModelParallel(Model(), device=torch.device("cpu"))
    params = dmp.parameters()
ft.wrap(dmp, torch.optim.SGD(params, lr=0.1), data=ft.StepSamples(per_step=4))
"""


@pytest.mark.parametrize(("built", "says"), [("ddp", "wrapped in DDP"), ("no lighthouse", "FREESCALE_LIGHTHOUSE"),
                                             ("unstepped table", "table 'small_table' is in no optimizer")])
def test_a_model_the_layer_cannot_keep_identical_is_refused_in_one_line(built: str, says: str, tmp_path: Path) -> None:
    """In a rank ``freescale launch`` owns, a refusal ends it with status 2 and one line for the launcher
    (``FREESCALE_ERROR_DIR``); in a plain interpreter the library raises a ``ValueError`` and changes none of
    the host's hooks, warnings filters or loggers (``ft.shard`` checked)."""
    import subprocess
    import sys

    from freescale.launch import ERROR_DIR_ENV
    from tests.conftest import REPO, cli_env

    env = {**cli_env(), "FREESCALE_LIGHTHOUSE": "" if built == "no lighthouse" else "http://127.0.0.1:9"}
    proc = subprocess.run([sys.executable, "-c", _REFUSED, built], cwd=REPO, env={**env, ERROR_DIR_ENV: str(tmp_path)},
                          capture_output=True, text=True, timeout=120)
    errors = [p.read_text() for p in tmp_path.glob("rank*.txt")]
    assert proc.returncode == 2 and len(errors) == 1 and says in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    if built != "unstepped table":
        return
    plain = subprocess.run([sys.executable, "-c", _REFUSED, built], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=120)
    last = plain.stderr.strip().splitlines()[-1]  # torch's own hook prefixes "[rank0]: "
    assert plain.returncode == 1 and "ValueError: " in last and says in last, plain.stderr[-2000:]
    assert "host untouched" in plain.stdout, plain.stdout


def test_the_layers_loss_scale_makes_the_in_group_average_the_groups_sample_mean() -> None:
    """Uneven shares (10 samples over 3 ranks): each rank's mean loss times the layer's scale, averaged over
    the ranks as the in-group reduction does, is the mean over the group's samples."""
    from types import SimpleNamespace

    from freescale.ft.layer import FaultTolerance

    values = torch.arange(10, dtype=torch.float64) ** 2  # a per-sample loss
    averaged = 0.0
    for rank in range(3):
        samples = StepSamples(per_step=10)
        samples.bind(0, 1, rank=rank, ranks=3)
        weight, scale = FaultTolerance._data_weight(SimpleNamespace(_data=samples, _step=0, _group_size=3), 0)
        assert weight == 10
        averaged += scale * float(values[samples.mine(0)].mean()) / 3
    assert averaged == pytest.approx(float(values.mean()))


def test_output_scaling_scales_every_path_once() -> None:
    """The wrapper scales copies of the outputs: a model returning ``(total, logits)`` where ``total`` is made
    from ``logits`` inside it gets every gradient path scaled once (a hook on each output would scale twice)."""
    from freescale.ft.wrapper import _map_tensors, _scaled

    w = torch.ones(3, requires_grad=True)
    logits = 2 * w
    total = logits.sum()
    found = [0]
    out = _map_tensors({"total": total, "parts": (logits, "label")}, lambda t: _scaled(t, 0.5, found))
    assert found[0] == 2 and out["parts"][1] == "label"
    (out["total"] + out["parts"][0].sum()).backward()
    assert torch.equal(w.grad, torch.full((3,), 2.0))  # unscaled: 4 per element


def test_step_samples_plan_a_group_on_fewer_ranks_a_share_in_proportion() -> None:
    """Group 1 of two groups of two ranks lost a rank (``Commit.sizes``): of 12 ids it trains 4 on its one
    rank, group 0 trains 8 on two; every id once, and a snapshot carries the sizes."""
    ranks = {(g, r): StepSamples(per_step=12) for g in range(2) for r in range(2)}
    for (g, r), samples in ranks.items():
        samples.bind(g, 2, rank=r, ranks=2)
        samples.running = 2 - g  # (what bind reads from the process group in a real rank)
        samples.commit(Commit(0, frozenset({0, 1}), frozenset({0, 1}), {0: 2, 1: 1}))
    live = [(0, 0), (0, 1), (1, 0)]
    assert [len(ranks[k].mine(1)) for k in live] == [4, 4, 4] and ranks[(1, 0)].weight(1) == 4
    assert sorted(i for k in live for i in ranks[k].mine(1).tolist()) == list(range(12, 24))
    late = StepSamples(per_step=12)
    late.bind(1, 2, rank=0, ranks=2)
    late.load_state_dict(ranks[(0, 0)].state_dict())
    # whole again, with the plan of a group on one rank (no vote named it at its new size): it sits the step out,
    # its weight 0, so the commit leaves it out and its share opens the next step; never trained twice
    assert late.mine(1).numel() == 0 and late.weight(1) == 0 and late.rank_samples(1) == 0
    share = ranks[(0, 0)].plan(1)[1]
    for samples in [*ranks.values(), late]:
        samples.commit(Commit(1, frozenset({0}), frozenset({0, 1}), {1: 2}))
    assert late.carry == share and late.plan(2) == ranks[(0, 0)].plan(2)
    assert sorted(i for ids in late.plan(2).values() for i in ids) == sorted(share + list(range(24, 36)))
    # the vote named it at its size: it trains its share of the next step on its two ranks
    assert late.weight(2) == 8 and late.mine(2).tolist() == late.plan(2)[1][0::2]
