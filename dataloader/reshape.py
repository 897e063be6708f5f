"""Resuming a loader position saved by a run of another shape: another global batch, world size or
replica count, another window or partitioner.  No sample of the epoch is skipped or repeated.

A position is only meaningful under the shape that planned it: global batch ``s`` of an epoch is
``[s*G, (s+1)*G)`` of the epoch's order, and a window's steps split its samples among *its* ranks.
So the saved state carries its shape (``shape_of``), and a loader of another shape rebuilds the
saved planner from it (the same order, window re-plans and carry: ``planner.py``), asks it what is
left of the epoch, and trains that as the epoch's *remainder*:

    left = the current window's samples not planned in its steps before the position
         + the rest of the epoch's order (up to the saved plan's last full batch)
         + the carry (rows requeued onto later steps: planned, never trained)

The remainder is planned with the new shape (``BatchPlanner.set_remainder``): ``len(left) // G'``
steps, and the last ``len(left) % G'`` rows carried onto the epoch's last step (or the next epoch's
first), so they are trained too.  The saved state stays in the new loader's state
(``reshaped_from``) while it is in that epoch: a second change of shape there rebuilds the first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from freescale.dataloader.cost import CostModel
from freescale.dataloader.epoch_order import EpochOrder
from freescale.dataloader.planner import BatchPlanner

SHAPE_KEYS = ("global_batch_size", "window", "partitioner", "equal_count", "locality", "max_seq_len", "seed",
              "shuffle", "shuffle_row_groups")


def shape_of(planner: BatchPlanner, max_seq_len: int | None) -> dict[str, Any]:
    """What decides a planner's plans besides its cost model (which the loader state holds already)."""
    order = planner.order
    return {"global_batch_size": planner.global_batch_size, "window": planner.window,
            "partitioner": planner.partitioner, "equal_count": planner.equal_count, "locality": planner.locality,
            "max_seq_len": max_seq_len, "seed": order.seed, "shuffle": order.shuffle,
            "shuffle_row_groups": order.window, "num_rows": order.num_rows,
            "row_groups": int(order.row_group_rows.size)}


def saved_planner(state: dict[str, Any], lengths: np.ndarray, row_group_rows: np.ndarray) -> BatchPlanner:
    """The planner that wrote ``state`` (a loader's ``state_dict``), at its position."""
    shape = state["shape"]
    order = EpochOrder(row_group_rows, seed=int(shape["seed"]), shuffle=bool(shape["shuffle"]),
                       window_row_groups=int(shape["shuffle_row_groups"]))
    planner = BatchPlanner(lengths, order, cost_model=CostModel(*state["cost_model"]),
                           partitioner=shape["partitioner"], global_batch_size=int(shape["global_batch_size"]),
                           window=int(shape["window"]), equal_count=bool(shape["equal_count"]),
                           max_seq_len=shape["max_seq_len"], locality=bool(shape["locality"]))
    if state.get("reshaped_from"):
        epoch, rows = remainder(state["reshaped_from"], lengths, row_group_rows)
        planner.set_remainder(epoch, rows)
    planner.load_window_state(state.get("window") or {})
    planner.load_carry_state(state.get("carry") or [])
    return planner


def remainder(state: dict[str, Any], lengths: np.ndarray, row_group_rows: np.ndarray) -> tuple[int, np.ndarray]:
    """``(epoch, rows)``: what the run that saved ``state`` had still to train of its epoch (module
    docstring), in its order, carried rows last."""
    planner = saved_planner(state, lengths, row_group_rows)
    epoch, step = int(state["epoch"]), int(state["step"])
    first, consumed = planner.planned_before(epoch, step)
    g = planner.global_batch_size
    ahead = planner.epoch_rows(epoch)[first * g: planner.steps_in(epoch) * g]
    left = ahead[~np.isin(ahead, consumed)]
    carried = [np.asarray(rows, dtype=np.int64) for _, _, rows in planner.carry_state(epoch, step)]
    return epoch, np.concatenate([left, *carried]) if carried else left


def start_remainder(planner: BatchPlanner, state: dict[str, Any], lengths: np.ndarray,
                    row_group_rows: np.ndarray) -> tuple[int, int]:
    """Set ``planner`` (another shape's) to train what ``state`` left of its epoch; the position to resume
    at.  The last rows short of a global batch are carried onto the remainder's last step (onto the next
    epoch's first when the remainder is shorter than one batch)."""
    epoch, rows = remainder(state, lengths, row_group_rows)
    planner.set_remainder(epoch, rows)
    planner.load_window_state({})
    planner.load_carry_state([])
    steps = planner.steps_in(epoch)
    leftover = rows[steps * planner.global_batch_size:]
    if leftover.size:
        planner.requeue(*((epoch, steps - 1) if steps else (epoch + 1, 0)), leftover)
    return (epoch, 0) if steps else (epoch + 1, 0)


__all__ = ["SHAPE_KEYS", "remainder", "saved_planner", "shape_of", "start_remainder"]
