"""Model shapes and gradient flow, unsharded (tables on CPU), one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from freescale.dataloader.cost import CostModel
from freescale.dataloader.build import DataConfig, build_loader
from freescale.dataloader.schema import DatasetManifest
from freescale.models import ModelConfig, build_model


def first_batch(path: Path, batch_size: int, features: list[str]):  # type: ignore[no-untyped-def]
    """The first ``batch_size`` rows of the split, in file order."""
    cfg = DataConfig(path=str(path), batch_size=batch_size, max_seq_len=32, shuffle=False,
                     partitioner="round_robin", prefetch=0)
    return build_loader(cfg, "train", rank=0, world_size=1, sparse_features=features,
                        derived_cost=CostModel(1, 1, 1), seed=0).next_batch()


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


def test_hstu_with_triton_kernels_matches_the_reference_model(tiny_data: Path) -> None:
    """The whole model, Triton attention and fused norm (interpreted on CPU) vs the torch references."""
    manifest = DatasetManifest.read(tiny_data)
    outputs = {}
    for backend in ("reference", "triton"):
        torch.manual_seed(0)
        cfg = ModelConfig(kind="hstu")
        cfg.hstu.attention_backend = cfg.hstu.norm_backend = backend
        model = build_model(cfg, manifest, max_seq_len=32, embedding_device=torch.device("cpu"))
        loss, _ = model(first_batch(tiny_data, 4, model.sparse_feature_names))
        loss.backward()
        outputs[backend] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (ref_loss, ref_grads), (tri_loss, tri_grads) = outputs["reference"], outputs["triton"]
    torch.testing.assert_close(tri_loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert tri_grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(tri_grads[name], ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
