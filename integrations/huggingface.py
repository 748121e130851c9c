"""Activation offload for Hugging Face ``Trainer`` switched on by configuration: no edit of the
training script.

    TIERSTORE_ACTIVATIONS=activations.toml python train.py --gradient_checkpointing ...

The variable is ``1`` (every default) or the path of a TOML or JSON document: an ``activations``
table holding [`ActivationOffload`][]'s options, beside the store's own config (``tiers``,
``cache``, ... as [`TierStore.from_config`][] reads them; without ``tiers``, the embedded default:
one NVMe tier under ``./tierstore-data``)::

    [activations]
    budget = "8GiB"                 # pinned host memory
    device_budget = "2GiB"
    plan = "all"
    scope = "checkpoint-inputs"     # with gradient checkpointing: only the layers' inputs leave the GPU

    [[tiers]]
    name = "nvme"
    backend = { type = "nvme", path = "/local/nvme/activations" }

tierstore installs ``tierstore-activations.pth`` into site-packages; Python runs its one line at
start-up, which imports this module only when the variable is set. `install` then adds
`ActivationsCallback` to the callbacks every ``Trainer`` starts with
(``transformers.trainer.DEFAULT_CALLBACKS``) as soon as ``transformers.trainer`` has been imported.
At the start of training the callback opens the store and an offloader attached to the model
([`ActivationOffload.attach`][]: forward hooks, so models wrapped by DDP or sharded by FSDP2's
``fully_shard`` work too; with ``scope = "checkpoint-inputs"``, the model's gradient checkpointing
marks its layers' inputs). Each step's report goes to the ``tierstore.activations`` logger; at the
end of training the offloader's figures are logged (INFO) and the offloader and store are closed.

A DeepSpeed run whose config has a ``tierstore.activations`` section (``TIERSTORE_DEEPSPEED``)
offloads through the engine already: both at once is refused with a [`ConfigError`][].
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from tierstore.activations import ActivationOffload, Attachment
from tierstore.activations.options import ActivationOptions

from tierstore.config import default_config, read_config_file
from tierstore.errors import ConfigError, config_error_from_validation
from tierstore.store import TierStore

from ._after_import import after_import

VARIABLE = "TIERSTORE_ACTIVATIONS"  # its test is repeated in tierstore-activations.pth, next to this file
SECTION = "activations"
ON = ("1", "true", "yes", "on")
OFF = ("", "0", "false", "no", "off")

_log = logging.getLogger("tierstore.activations")


def requested() -> bool:
    """Whether `VARIABLE` switches activation offload on."""
    return os.environ.get(VARIABLE, "").strip().lower() not in OFF


@dataclass(frozen=True)
class Settings:
    """What `VARIABLE` asks for."""

    store: dict[str, Any]
    """The store's config document (for [`TierStore.from_config`][])."""
    options: ActivationOptions
    """The offloader's options."""


def settings(value: str | None = None) -> Settings:
    """The settings `VARIABLE` (or ``value``) names.

    Args:
        value: ``1`` (or ``true``, ``yes``, ``on``) for every default, or the path of a TOML or JSON
            document (see the module docstring); None reads `VARIABLE`.

    Raises:
        ConfigError: the file cannot be read or parsed, or an option is invalid (the message
            names it, ``activations.budget`` say).
    """
    value = os.environ.get(VARIABLE, "") if value is None else value
    document: dict[str, Any] = {}
    if value.strip().lower() not in ON:
        path = Path(value)
        if path.suffix not in (".toml", ".json"):
            raise ConfigError(f"{VARIABLE}: give 1 or the path of a .toml or .json file, not {value!r}")
        try:
            document = read_config_file(path)
        except ConfigError as error:
            raise ConfigError(f"{VARIABLE}: {error}") from None
    table = document.pop(SECTION, {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"{SECTION}: must be a table of ActivationOffload's options, not {table!r}")
    try:
        options = ActivationOptions.model_validate(dict(table))
    except ValidationError as error:
        raise config_error_from_validation(error, SECTION) from None
    store = document if "tiers" in document else {**default_config(), **document}
    return Settings(store, options)


def install() -> None:
    """Add `ActivationsCallback` to every ``Trainer``'s default callbacks, now if
    ``transformers.trainer`` is imported, else right after it is."""
    after_import("transformers.trainer", _add_callback)


def _add_callback() -> None:
    import transformers.trainer

    callback = activations_callback()
    if callback not in transformers.trainer.DEFAULT_CALLBACKS:
        transformers.trainer.DEFAULT_CALLBACKS.append(callback)


@functools.cache
def activations_callback() -> type[Any]:
    """`ActivationsCallback`, a ``transformers.TrainerCallback`` (made at the first call: this
    module imports no part of transformers before the training script does)."""
    from transformers import TrainerCallback

    class ActivationsCallback(TrainerCallback):
        """Offloads the activations of the model a ``Trainer`` trains, from the start of training to
        its end, as `VARIABLE` says (see the module docstring)."""

        def __init__(self) -> None:
            self.store: TierStore | None = None
            self.offload: ActivationOffload | None = None
            self.attachment: Attachment | None = None

        def on_train_begin(
            self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
        ) -> None:
            if model is None or self.offload is not None:
                return
            _refuse_deepspeed_activations(args)
            chosen = settings()
            store = TierStore.from_config(chosen.store)
            try:
                self.offload = ActivationOffload(store, **chosen.options.model_dump())
            except BaseException:
                store.close()
                raise
            self.store = store
            self.attachment = self.offload.attach(model)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.close()

        def close(self) -> None:
            """Detach the offloader and close it and its store."""
            attachment, offload, store = self.attachment, self.offload, self.store
            self.attachment = self.offload = self.store = None
            if attachment is not None:
                attachment.remove()
            if offload is not None:
                _log.info("tierstore activations: %s", json.dumps(offload.stats(), default=str))
                offload.close()
            if store is not None:
                store.close()

    return ActivationsCallback


def _refuse_deepspeed_activations(args: Any) -> None:
    """Refuse a run whose DeepSpeed config also offloads activations through tierstore."""
    config = getattr(args, "deepspeed", None)
    if not config:
        return
    from tierstore.integrations.deepspeed import read_config

    section = read_config(config).get("tierstore")
    if isinstance(section, Mapping) and section.get(SECTION) is not None:
        raise ConfigError(
            f"{VARIABLE} and the DeepSpeed config's tierstore.{SECTION} both offload activations; "
            "keep one of them"
        )


if requested():  # TIERSTORE_ACTIVATIONS set without the .pth (an install that skipped it)
    install()
