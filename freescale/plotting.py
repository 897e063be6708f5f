"""matplotlib, an optional extra (``pip install -e '.[report]'``; ``make test``/``make demo`` install it).

``pyplot()`` gives ``matplotlib.pyplot`` on the non-interactive Agg backend (files only, no
display needed), or raises ``PlottingUnavailable`` with the one line that says how to install it.
"""

from __future__ import annotations

from types import ModuleType

from freescale.config import ConfigError

INSTALL_HINT = "matplotlib is not installed: pip install -e '.[report]' (make test / make demo install it)"


class PlottingUnavailable(ConfigError):
    """matplotlib is missing (one line with the install command)."""


def pyplot() -> ModuleType:
    try:
        import matplotlib
    except ImportError:
        raise PlottingUnavailable(INSTALL_HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
