"""Model shapes and gradient flow, unsharded (tables on CPU), one process."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from freescale.dataloader.cost import CostModel
from freescale.dataloader.build import DataConfig, build_loader, item_counts
from freescale.dataloader.schema import HISTORY_ITEMS, DatasetManifest
from freescale.models import ModelConfig, build_model
from freescale.models.hstu_retrieval import next_item_index


def first_batch(path: Path, batch_size: int, features: list[str], timestamps: bool = False,  # type: ignore[no-untyped-def]
                sampled_items: int = 0):
    """The first ``batch_size`` rows of the split, in file order."""
    cfg = DataConfig(path=str(path), batch_size=batch_size, max_seq_len=32, shuffle=False,
                     partitioner="round_robin", prefetch=0)
    return build_loader(cfg, "train", rank=0, world_size=1, sparse_features=features, derived_cost=CostModel(1, 1, 1),
                        seed=0, timestamps=timestamps, sampled_items=sampled_items).next_batch()


@pytest.mark.parametrize("kind", ["hstu", "dlrm"])
def test_forward_shapes_and_every_parameter_gets_a_gradient(kind: str, tiny_data: Path) -> None:
    torch.manual_seed(0)
    manifest = DatasetManifest.read(tiny_data)
    model = build_model(ModelConfig(kind=kind), manifest, max_seq_len=32, embedding_device=torch.device("cpu"))
    batch = first_batch(tiny_data, 16, model.sparse_feature_names)
    loss, (detached, logits, labels) = model(batch)
    assert loss.shape == () and torch.isfinite(loss)
    assert logits.shape == (16,) and labels.shape == (16,)
    assert detached == loss.detach()
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad.to_dense() if param.grad.is_sparse else param.grad).all(), name
        assert param.grad.abs().sum() > 0 or "bias" in name, name


def test_hstu_scores_each_sample_independently_of_its_batch(tiny_data: Path) -> None:
    torch.manual_seed(0)
    manifest = DatasetManifest.read(tiny_data)
    model = build_model(ModelConfig(kind="hstu"), manifest, max_seq_len=32, embedding_device=torch.device("cpu"))
    features = model.sparse_feature_names
    with torch.no_grad():
        _, (_, logits_big, _) = model(first_batch(tiny_data, 8, features))
        _, (_, logits_small, _) = model(first_batch(tiny_data, 2, features))
    torch.testing.assert_close(logits_big[:2], logits_small, rtol=1e-5, atol=1e-6)


def relative_bias_model(tiny_data: Path, relative_bias: str, backend: str = "reference"):  # type: ignore[no-untyped-def]
    """The tiny HSTU with ``relative_bias``, its tables set to random values (they start at zero)."""
    torch.manual_seed(0)
    cfg = ModelConfig(kind="hstu")
    cfg.hstu.attention_backend = cfg.hstu.norm_backend = backend
    cfg.hstu.relative_bias = relative_bias
    model = build_model(cfg, DatasetManifest.read(tiny_data), max_seq_len=32, embedding_device=torch.device("cpu"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("position_bias", "time_bias")):
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return model


def test_relative_bias_reads_the_batch_timestamps_and_learns(tiny_data: Path) -> None:
    """``position_time``: the loader hands the history's timestamps (and, format 1 having no candidate time,
    the newest history one as the candidate's) to the model; both tables of every block get gradients,
    and the time table changes the output (another batch's timestamps change the logits)."""
    model = relative_bias_model(tiny_data, "position_time")
    assert model.reads_timestamps
    batch = first_batch(tiny_data, 8, model.sparse_feature_names, timestamps=True)
    lengths = batch.sparse[HISTORY_ITEMS].lengths()
    assert batch.history_timestamps.shape == batch.sparse[HISTORY_ITEMS].values().shape
    newest = batch.history_timestamps[torch.cumsum(lengths, 0)[lengths > 0] - 1]
    assert torch.equal(batch.candidate_timestamps[lengths > 0], newest)
    loss, (_, logits, _) = model(batch)
    loss.backward()
    tables = {n: p.grad for n, p in model.named_parameters() if n.endswith(("position_bias", "time_bias"))}
    assert len(tables) == 4 and all(g is not None and g.abs().sum() > 0 for g in tables.values()), tables
    shifted = copy.copy(batch)
    shifted.history_timestamps = batch.history_timestamps - 10_000 * torch.arange(batch.history_timestamps.numel())
    with torch.no_grad():
        _, (_, moved, _) = model(shifted)
    assert not torch.allclose(moved, logits.detach())
    with pytest.raises(ValueError, match="the batch carries no timestamps"):
        model(first_batch(tiny_data, 8, model.sparse_feature_names))


@pytest.mark.parametrize("relative_bias", ["none", "position_time"])
def test_hstu_with_triton_kernels_matches_the_reference_model(tiny_data: Path, relative_bias: str) -> None:
    """The whole model, Triton attention and fused norm (interpreted on CPU) vs the torch references."""
    outputs = {}
    for backend in ("reference", "triton"):
        model = relative_bias_model(tiny_data, relative_bias, backend)
        loss, _ = model(first_batch(tiny_data, 4, model.sparse_feature_names, timestamps=model.reads_timestamps))
        loss.backward()
        outputs[backend] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (ref_loss, ref_grads), (tri_loss, tri_grads) = outputs["reference"], outputs["triton"]
    torch.testing.assert_close(tri_loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert tri_grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(tri_grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_each_history_position_targets_the_next_item_and_the_last_the_candidate() -> None:
    index, last = next_item_index(torch.tensor([3, 0, 1, 2]))
    # History tokens 0-2 (sample 0), 3 (sample 2), 4-5 (sample 3); candidates at 6 + sample.
    assert index.tolist() == [1, 2, 6, 8, 5, 9] and last.tolist() == [False, False, True, True, False, True]


@pytest.mark.parametrize(("kind", "positions"), [("hstu", "all"), ("hstu", "last"), ("sasrec", "all")])
def test_retrieval_model_learns_next_items_and_hands_queries_to_evaluation(tiny_data: Path, kind: str,
                                                                          positions: str) -> None:
    """The sampled softmax (in-batch and 16 uniform negatives, logQ from the data's target counts) over every
    history position, or the last, with either encoder: it falls on a fixed batch as the model trains;
    evaluation gets one unit-norm query per sample with a history, and that sample's candidate."""
    torch.manual_seed(0)
    cfg = ModelConfig(kind=kind, task="retrieval")  # type: ignore[arg-type]  # (the CLI's choices)
    cfg.sasrec.embedding_dim = cfg.hstu.embedding_dim
    cfg.retrieval.uniform_negatives, cfg.retrieval.positions = 16, positions
    counts = torch.from_numpy(item_counts(DataConfig(path=str(tiny_data), max_seq_len=32)))
    model = build_model(cfg, DatasetManifest.read(tiny_data), max_seq_len=32, embedding_device=torch.device("cpu"),
                        item_counts=counts)
    batch = first_batch(tiny_data, 16, model.sparse_feature_names, sampled_items=16)
    lengths = batch.sparse[HISTORY_ITEMS].lengths()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss, (_, total, supervised, samples) = model(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    want = int(lengths.sum()) if positions == "all" else int((lengths > 0).sum())
    assert int(supervised) == want and int(samples) == 16
    assert float(total) * batch.loss_scale == pytest.approx(losses[-1], rel=1e-5)  # a sum over positions, per sample
    assert losses[-1] < 0.7 * losses[0], losses
    model.eval()
    with torch.no_grad():
        _, (_, query, target) = model(batch)
    has = lengths > 0
    assert query.shape == (int(has.sum()), cfg.hstu.embedding_dim)
    assert torch.allclose(query.norm(dim=1), torch.ones(query.shape[0]))
    assert torch.equal(target, batch.sparse["candidate_item_id"].values()[has])


def test_the_ranking_head_reads_the_history_candidate_product() -> None:
    """``history_cross``: after the candidate's output, the sequence hands the head
    ``LayerNorm(mean history embedding) * LayerNorm(candidate embedding)`` per sample (an empty history:
    zeros), so the head is ``embedding_dim`` wider; off, the output alone."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    from freescale.models.hstu import HSTUConfig, HSTUSequence

    torch.manual_seed(0)
    d, lengths = 8, torch.tensor([3, 0, 1])
    history, candidate = torch.randn(4, d), torch.randn(3, d)
    jagged = JaggedTensor(values=history, lengths=lengths), JaggedTensor(values=candidate, lengths=torch.ones(3).long())
    crossed = HSTUSequence(HSTUConfig(embedding_dim=d), 8)
    plain = HSTUSequence(HSTUConfig(embedding_dim=d, history_cross=False), 8)
    plain.load_state_dict(crossed.state_dict())  # no parameters of its own
    out = crossed(*jagged)
    assert out.shape == (3, 2 * d)
    torch.testing.assert_close(out[:, :d], plain(*jagged))
    means = torch.stack([history[:3].mean(0), torch.zeros(d), history[3]])
    expected = torch.nn.functional.layer_norm(means, (d,)) * torch.nn.functional.layer_norm(candidate, (d,))
    torch.testing.assert_close(out[:, d:], expected)
    assert out[1, d:].abs().max() == 0


@pytest.mark.parametrize(("attention", "ffn"), [("softmax", 1), ("silu", 1), ("silu", 0)])
def test_sasrec_is_causal_and_each_sample_is_its_own(attention: str, ffn: int) -> None:
    """Each position's output reads only the positions before it, and a sample's outputs do not depend on the other
    samples of the batch (padding included): changing later tokens, or a neighbour, changes nothing before them.
    The same for the ablation's HSTU-like switches (pointwise SiLU weights, no feed-forward layer)."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    from freescale.models.sasrec import PointwiseSelfAttention, SASRecConfig, SASRecNextItem

    torch.manual_seed(0)
    cfg = SASRecConfig(embedding_dim=8, num_blocks=2, num_heads=2, dropout=0.0, attention=attention, ffn_multiplier=ffn)
    encoder = SASRecNextItem(cfg, max_tokens=16).eval()
    assert any(isinstance(m, PointwiseSelfAttention) for m in encoder.modules()) == (attention == "silu")
    assert any(isinstance(m, torch.nn.GELU) for m in encoder.modules()) == (ffn > 0)
    lengths = torch.tensor([5, 0, 3])
    values = torch.randn(8, 8)
    out = encoder(JaggedTensor(values=values, lengths=lengths))
    changed = values.clone()
    changed[3:5] += torch.randn(2, 8)  # the last two tokens of sample 0 (a constant shift: invisible to LayerNorm)
    again = encoder(JaggedTensor(values=changed, lengths=lengths))
    assert torch.allclose(out[:3], again[:3], atol=1e-6) and not torch.allclose(out[3:5], again[3:5])
    assert torch.allclose(out[5:], again[5:], atol=1e-6)  # sample 2, beside a changed neighbour
    alone = encoder(JaggedTensor(values=values[5:], lengths=torch.tensor([3])))
    assert torch.allclose(out[5:], alone, atol=1e-6)


def test_hstu_dropout_acts_in_training_only_and_at_zero_builds_nothing() -> None:
    """``model.hstu.dropout``: in training two passes over the same tokens differ, in evaluation they agree (and
    equal the model's output with dropout left out); at 0 the stack holds no dropout module (a run without it draws
    nothing from the generator: the same steps as before it existed)."""
    from torchrec.sparse.jagged_tensor import JaggedTensor

    from freescale.models.hstu import HSTUConfig
    from freescale.models.hstu_retrieval import HSTUNextItem

    torch.manual_seed(0)
    cfg = HSTUConfig(embedding_dim=8, num_heads=2, attention_dim=4, value_dim=4, dropout=0.5,
                     attention_backend="reference", norm_backend="reference")
    encoder = HSTUNextItem(cfg, max_tokens=16)
    history = JaggedTensor(values=torch.randn(8, 8), lengths=torch.tensor([5, 3]))
    assert not torch.equal(encoder(history), encoder(history))
    encoder.eval()
    plain = HSTUNextItem(HSTUConfig(**{**cfg.__dict__, "dropout": 0.0}), max_tokens=16).eval()
    plain.load_state_dict(encoder.state_dict())
    assert torch.equal(encoder(history), encoder(history)) and torch.equal(encoder(history), plain(history))
    assert not any(isinstance(m, torch.nn.Dropout) for m in plain.modules())
