"""Offloaded ZeRO-3 optimizers: fp32 sub-group state staged through a TierStore.

AdamW and APOLLO share one staging engine. Both are usable on their own with a plain PyTorch model
(single process); the DeepSpeed integration plugs the AdamW path in.
"""

from .adamw import OffloadedAdamW
from .apollo import APOLLO_MINI, OffloadedAPOLLO
from .engine import StagedOptimizer, StaleMasterWeightsError
from .partition import Piece, SubGroup, partition, partition_whole

__all__ = [
    "APOLLO_MINI",
    "OffloadedAPOLLO",
    "OffloadedAdamW",
    "Piece",
    "StagedOptimizer",
    "StaleMasterWeightsError",
    "SubGroup",
    "partition",
    "partition_whole",
]
