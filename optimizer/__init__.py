"""Offloaded ZeRO-3 optimizer: fp32 sub-group state staged through a TierStore.

Usable on its own with a plain PyTorch model (single process); the DeepSpeed integration plugs the
same optimizer in.
"""

from .adamw import OffloadedAdamW
from .partition import Piece, SubGroup, partition

__all__ = ["OffloadedAdamW", "Piece", "SubGroup", "partition"]
