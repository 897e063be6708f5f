"""Several side channels on the one side header fault tolerance carries (``freescale.step_types.SideChannel``).

The layer carries one side header beside each step's sample weight; the job's rank speeds
(``freescale.speed_share``) and the validation metric (``freescale.validation``) both ride on it.  Each channel's
header has a fixed length (``size``, the same on every group), so the joined header is their concatenation and
each group's is cut back into its channels' parts at the commit, in the same order everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from freescale.step_types import Commit, SideChannel


class SideChannels:
    """``channels`` as one ``SideChannel``."""

    name = "side_channels"

    def __init__(self, channels: Sequence[SideChannel]) -> None:
        self.channels = list(channels)

    @property
    def size(self) -> int:
        return sum(c.size for c in self.channels)

    def header(self) -> torch.Tensor:
        return torch.cat([c.header().reshape(-1).to(torch.int64) for c in self.channels])

    def on_commit(self, commit: Commit, headers: dict[int, torch.Tensor]) -> None:
        at = 0
        for channel in self.channels:
            channel.on_commit(commit, {g: h[at:at + channel.size] for g, h in headers.items()})
            at += channel.size

    def notes(self) -> dict[str, Any]:
        return {k: v for c in self.channels for k, v in c.notes().items()}

    def state_dict(self) -> dict[str, Any]:
        return {c.name: c.state_dict() for c in self.channels}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for channel in self.channels:
            if channel.name in state:
                channel.load_state_dict(state[channel.name])
