from __future__ import annotations

from pathlib import Path

import pytest

from freescale.config import ConfigError, load_config, parse_overrides
from freescale.trainer import TrainerConfig

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["tiny_hstu", "tiny_dlrm"])
def test_shipped_configs_load(name: str) -> None:
    cfg = load_config(TrainerConfig, REPO / "configs" / f"{name}.toml")
    assert cfg.model.kind == name.split("_")[1]
    assert cfg.train.steps > 0


def test_overrides_take_precedence_and_convert_types() -> None:
    cfg = load_config(
        TrainerConfig,
        REPO / "configs" / "tiny_hstu.toml",
        ["--train.steps", "7", "--optim.dense_lr=0.01", "--model.hstu.head_layers", "16,8", "--data.shuffle", "false"],
    )
    assert cfg.train.steps == 7
    assert cfg.optim.dense_lr == 0.01
    assert cfg.model.hstu.head_layers == [16, 8]
    assert cfg.data.shuffle is False


def test_parse_overrides_accepts_both_spellings() -> None:
    assert parse_overrides(["--a.b", "1", "--c-d=2"]) == [("a.b", "1"), ("c_d", "2")]


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["--train.stpes", "5"], "unknown config key 'train.stpes' (did you mean 'train.steps'?)"),
        (["--trian.steps", "5"], "unknown config key 'trian'"),
        (["--train.steps", "five"], "train.steps: expected int, got 'five'"),
        (["--train.steps", "0"], "train.steps: must be positive"),
        (["--model.kind", "gpt"], "model.kind: expected one of 'hstu', 'dlrm'"),
        (["--model.dlrm.bottom_layers", "32,8"], "model.dlrm.bottom_layers: last width 8 must equal embedding_dim 16"),
        (["--train", "5"], "train: is a section"),
        (["--train.steps"], "--train.steps: missing value"),
        (["steps=5"], "unexpected argument 'steps=5'"),
        (["--optim.sharding", "item_table=colum_wise"], "optim.sharding: 'colum_wise' for item_table is not one of"),
        (["--optim.sparse_lr", "inf"], "optim.sparse_lr: must be positive and finite, got inf"),  # (every loss nan)
    ],
)
def test_bad_overrides_name_the_key(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(TrainerConfig, None, overrides)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_toml_names_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[train]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match=r"bad.toml: train.steps: expected int, got 'ten'"):
        load_config(TrainerConfig, path)
    path.write_text("[model]\nkind = 'hstu'\nlayers = 3\n")
    with pytest.raises(ConfigError, match=r"bad.toml: unknown config key 'model.layers'"):
        load_config(TrainerConfig, path)
    path.write_text("[train\n")
    with pytest.raises(ConfigError, match="bad.toml: invalid TOML"):
        load_config(TrainerConfig, path)


def test_missing_config_file() -> None:
    with pytest.raises(ConfigError, match="config file not found: nope.toml"):
        load_config(TrainerConfig, "nope.toml")
    with pytest.raises(ConfigError, match=r"config file not found: configs \(a directory; name a .toml file in it\)"):
        load_config(TrainerConfig, "configs")
