"""Every point where tierstore plugs into DeepSpeed ZeRO-3 (0.19.x), and the engine's own seams.

Nothing here edits DeepSpeed; each seam is an override or a scoped substitution, checked by
`check_seams` before use (a DeepSpeed that renamed one fails with a clear error, not silently):

1. ``engine._configure_zero_optimizer`` imports ``stage3.DeepSpeedZeroOptimizer_Stage3`` when it
   runs: `substituted_optimizer` swaps in `TierStoreZeroOptimizer` for the duration of
   ``deepspeed.initialize`` and restores it after.
2. to 5. and 7.: that subclass's overrides (`zero_optimizer`, which says what each does): the
   optimizer-state swapper (`TierStoreSwapper`, state in a TierStore through a `SubGroupStager`),
   the gradients kept in low precision and converted per sub-group, the cache-friendly sub-group
   order, and the optimizer state in checkpoints (`checkpoints`).
6. ``engine.forward``: with ``tierstore.activations`` in the section, `offload_activations` wraps
   the engine's forward (an instance attribute over the method) in an [`ActivationOffload`][] on the
   swapper's store.
8. ``engine.save_checkpoint``/``load_checkpoint``: `tierstore_checkpoints` wraps them (instance
   attributes) to tell the optimizer the checkpoint's folder, so that stock DeepSpeed refuses a
   tierstore checkpoint loudly instead of silently restarting from fresh optimizer state, and so
   that an import finds DeepSpeed's ZeRO file.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import deepspeed.runtime.zero.stage3 as stage3
from tierstore.activations import ActivationOffload

from tierstore.errors import ConfigError, UnsupportedVersionError

from .checkpoints import CHECKPOINT_FORMAT, checkpoint_folder
from .config import SECTION, ActivationsSection
from .zero_optimizer import RELIED_ON, StockZeroOptimizer, TierStoreZeroOptimizer

ENGINE_RELIED_ON = ("save_checkpoint", "load_checkpoint", "_get_zero_ckpt_name")
"""The methods of ``DeepSpeedEngine`` `tierstore_checkpoints` wraps or calls."""
CHECKPOINT_MARK = "tierstore"
"""The key of the `TierstoreCheckpointMark` in a checkpoint's client state."""


def check_seams() -> None:
    """Fail clearly if this DeepSpeed lacks a method the overrides rely on."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    missing = [name for name in RELIED_ON if not callable(getattr(StockZeroOptimizer, name, None))]
    missing += [name for name in ENGINE_RELIED_ON if not callable(getattr(DeepSpeedEngine, name, None))]
    if missing:
        raise UnsupportedVersionError(
            "this DeepSpeed's ZeRO-3 optimizer or engine lacks "
            + ", ".join(missing)
            + "; tierstore cannot plug in"
        )


@contextmanager
def substituted_optimizer() -> Iterator[None]:
    """Make the engine build `TierStoreZeroOptimizer` (process-wide, so only while inside)."""
    check_seams()
    stage3.DeepSpeedZeroOptimizer_Stage3 = TierStoreZeroOptimizer
    try:
        yield
    finally:
        stage3.DeepSpeedZeroOptimizer_Stage3 = StockZeroOptimizer


def offload_activations(engine: Any, settings: ActivationsSection) -> ActivationOffload:
    """Spill what the engine's forward saves for backward through the optimizer's store (one store,
    one set of tiers and limits for both workloads); ``engine.tierstore_activations`` holds it."""
    store = engine.optimizer.optimizer_swapper.store
    offload = ActivationOffload(store, **settings.model_dump())
    forward = engine.forward

    @functools.wraps(forward)
    def offloaded_forward(*args: Any, **kwargs: Any) -> Any:
        if settings.scope == "checkpoint-inputs":
            offload.mark_regions(engine.module)
        with offload:
            return forward(*args, **kwargs)

    engine.forward = offloaded_forward
    engine.tierstore_activations = offload
    weakref.finalize(engine, offload.close)
    return offload


_loading_with_tierstore: ContextVar[bool] = ContextVar("tierstore_loading", default=False)


def tierstore_checkpoints(engine: Any) -> None:
    """Seam 8: wrap the engine's ``save_checkpoint`` (instance attributes over the methods, which
    ``Trainer`` reaches through ``model_wrapped``) to put a `TierstoreCheckpointMark` into the
    engine's model-states file, and ``load_checkpoint`` to accept it and to tell the optimizer which
    ZeRO checkpoint file the load reads (the engine skips that file with NVMe offload)."""
    save, load = engine.save_checkpoint, engine.load_checkpoint

    @functools.wraps(save)
    def save_checkpoint(
        save_dir: str, tag: Any = None, client_state: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        tag = f"global_step{engine.global_steps}" if tag is None else str(tag)  # as DeepSpeed names it
        client_state = {**(client_state or {}), CHECKPOINT_MARK: TierstoreCheckpointMark()}
        engine.optimizer.tierstore_checkpoint_dir = checkpoint_folder(save_dir, tag)
        try:
            return save(save_dir, tag, client_state, *args, **kwargs)
        finally:
            engine.optimizer.tierstore_checkpoint_dir = None

    @functools.wraps(load)
    def load_checkpoint(load_dir: str, tag: Any = None, *args: Any, **kwargs: Any) -> Any:
        latest = os.path.join(load_dir, "latest")
        if tag is None and os.path.isfile(latest):
            with open(latest) as source:
                tag = source.read().strip()
        if tag is not None:
            engine.optimizer.tierstore_checkpoint_file = engine._get_zero_ckpt_name(load_dir, tag)
            engine.optimizer.tierstore_checkpoint_dir = checkpoint_folder(load_dir, str(tag))
        token = _loading_with_tierstore.set(True)
        try:
            return load(load_dir, tag, *args, **kwargs)
        finally:
            _loading_with_tierstore.reset(token)
            engine.optimizer.tierstore_checkpoint_file = None
            engine.optimizer.tierstore_checkpoint_dir = None

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint


class TierstoreCheckpointMark:
    """Pickled into a tierstore checkpoint's model-states file, which every DeepSpeed load reads:
    unpickling it outside a tierstore load fails, so stock DeepSpeed (whose NVMe-offload load
    would ignore tierstore's state and silently go on from its own fresh swap files) stops."""

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return (_check_tierstore_load, (CHECKPOINT_FORMAT,))


def _check_tierstore_load(checkpoint_format: int) -> dict[str, int]:
    """What unpickling a `TierstoreCheckpointMark` runs. Checkpoints name it by module and name
    (``tierstore.integrations.deepspeed.seams._check_tierstore_load``): both are part of the
    checkpoint format."""
    if not _loading_with_tierstore.get():
        raise ConfigError(
            f"{SECTION}: this checkpoint's optimizer state was written by tierstore; load it with a "
            f"'{SECTION}' section in the DeepSpeed config and tierstore enabled "
            "(TIERSTORE_DEEPSPEED=1 or tierstore.integrations.deepspeed.enable()): stock DeepSpeed "
            "would restart from its own initial optimizer state"
        )
    return {"checkpoint_format": checkpoint_format}
