"""Activation spill: tensors saved for backward go to a TierStore during forward and come back
before backward needs them (SSDTrain's mechanics, TERAIO's lifetime-aware plan).

>>> from tierstore.activations import ActivationOffload
>>> offload = ActivationOffload(store, budget="512MiB", min_bytes="1MiB", plan="lifetime")  # doctest: +SKIP
>>> with offload:                                                                          # doctest: +SKIP
...     loss = model(batch)
>>> loss.backward()                                                                        # doctest: +SKIP
"""

from .offload import ActivationOffload, Attachment
from .options import PLANS, SCOPES, Plan, Scope

__all__ = ["PLANS", "SCOPES", "ActivationOffload", "Attachment", "Plan", "Scope"]
