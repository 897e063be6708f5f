"""freescale: recommendation-model training on torchrec that keeps every rank busy.

Public API::

    from freescale import Trainer, TrainerConfig, load_config
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from freescale.config import ConfigError, load_config
    from freescale.trainer import Trainer, TrainerConfig, TrainSummary

_LAZY = {
    "Trainer": "freescale.trainer",
    "TrainerConfig": "freescale.trainer",
    "TrainSummary": "freescale.trainer",
    "load_config": "freescale.config",
    "ConfigError": "freescale.config",
}


def __getattr__(name: str) -> Any:
    # Lazy so that `import freescale.dataloader` (and `freescale --help`) do not pay
    # for importing torchrec.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'freescale' has no attribute {name!r}")


__all__ = ["ConfigError", "TrainSummary", "Trainer", "TrainerConfig", "__version__", "load_config"]
