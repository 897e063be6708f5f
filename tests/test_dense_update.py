"""The committed step's dense update (``freescale/dense_update.py``): the schedule's factors, clipping, and
the rates it sets on the dense optimizer and on the fused tables."""

from __future__ import annotations

import math

import pytest
import torch

from freescale.config import ConfigError
from freescale.dense_update import DenseUpdate, LRSchedule
from freescale.parallelize import OptimConfig


def test_schedules_warm_up_then_decay_to_the_floor() -> None:
    cosine = LRSchedule("warmup_cosine", warmup_steps=4, total_steps=14, min_ratio=0.1)
    assert [cosine.factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cosine.factor(4) == pytest.approx(1.0)
    assert cosine.factor(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert cosine.factor(14) == pytest.approx(0.1) and cosine.factor(1000) == pytest.approx(0.1)
    linear = LRSchedule("warmup_linear", warmup_steps=0, total_steps=10)
    assert [round(linear.factor(s), 6) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    constant = LRSchedule("constant", warmup_steps=2)
    assert [constant.factor(s) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert not LRSchedule().active and constant.active


class FakeTable:
    """What ``DenseUpdate`` uses of an fbgemm TBE: its learning rate."""

    def __init__(self, lr: float) -> None:
        self.lr, self.sets = lr, 0

    def get_learning_rate(self) -> float:
        return self.lr

    def set_learning_rate(self, lr: float) -> None:
        self.lr, self.sets = lr, self.sets + 1


def test_update_clips_the_global_norm_and_scales_every_rate() -> None:
    weight = torch.nn.Parameter(torch.zeros(3))
    bias = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([weight, bias], lr=0.5)
    table = FakeTable(0.05)
    update = DenseUpdate([optimizer], [weight, bias], LRSchedule("warmup_linear", 2, 10), clip_norm=1.0,
                         tables=[table])
    weight.grad, bias.grad = torch.full((3,), 3.0), torch.full((4,), 4.0)  # norm sqrt(27 + 64)
    update.before_tables(0)
    update.apply(0)
    norm = math.sqrt(27 + 64)
    assert update.record == {"lr_factor": 0.5, "grad_norm": pytest.approx(norm)}
    assert optimizer.param_groups[0]["lr"] == 0.25 and table.lr == pytest.approx(0.025)
    # SGD at rate 0.25 on the clipped gradient (norm 1).
    assert torch.allclose(weight, -0.25 * 3.0 / norm * torch.ones(3)) and torch.allclose(bias, -0.25 * 4.0 / norm * torch.ones(4))
    table.lr = 0.05  # as torchrec's fused optimizer does in every zero_grad
    update.before_tables(0)
    assert table.lr == pytest.approx(0.025)
    update.before_tables(1)
    assert table.lr == pytest.approx(0.05)


def test_without_a_schedule_the_rates_are_left_to_the_user() -> None:
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    update = DenseUpdate([optimizer], [weight], LRSchedule())
    for step in range(3):
        weight.grad = torch.ones(2)
        update.apply(step)
        scheduler.step()
    assert update.record == {} and optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("lr_schedule", "step", "lr_schedule: must be one of constant, warmup_cosine, warmup_linear, got 'step'"),
    ("clip_grad_norm", -1.0, "clip_grad_norm: must be >= 0 (0: off), got -1.0"),
    ("min_lr_ratio", 2.0, "min_lr_ratio: must be in [0, 1], got 2.0"),
    ("warmup_steps", -3, "warmup_steps: must be >= 0, got -3")])
def test_bad_settings_are_named(field: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        OptimConfig(**{field: value}).validate()  # type: ignore[arg-type]


def test_bf16_is_cuda_autocast_and_refused_on_cpu(tiny_data: object, capsys: pytest.CaptureFixture[str]) -> None:
    """``train.precision``: bf16 autocasts the step on CUDA (weights stay fp32); on a CPU run it is one line."""
    from freescale.cli import main
    from freescale.step_engine import precision_context

    context = precision_context(torch.device("cuda", 0), "bf16")
    assert isinstance(context, torch.autocast) and context.fast_dtype == torch.bfloat16 and context.device == "cuda"
    assert not isinstance(precision_context(torch.device("cpu"), "bf16"), torch.autocast)
    assert not isinstance(precision_context(torch.device("cuda", 0), "fp32"), torch.autocast)
    code = main(["train", "--config", "configs/tiny_dlrm.toml", f"--data.path={tiny_data}", "--train.precision=bf16",
                 "--dist.backend=gloo"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["freescale: error: train.precision: 'bf16' autocasts the step on CUDA, and this run "
                                 "is on CPU (dist.backend = gloo); use 'fp32'"], err
    assert main(["train", "--config", "configs/tiny_dlrm.toml", f"--data.path={tiny_data}",
                 "--train.precision=fp16"]) == 2
    assert "train.precision: must be one of ['fp32', 'bf16'], got 'fp16'" in capsys.readouterr().err
