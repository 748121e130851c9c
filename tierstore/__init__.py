"""tierstore: a tiered tensor store for spilling large torch tensors to DRAM, NVMe and PFS tiers.

>>> import torch, tierstore
>>> with tierstore.TierStore.from_config({"tiers": [{"name": "ram", "backend": "dram://"}]}) as store:
...     store["w"] = torch.arange(4.0)
...     store["w"].tolist()
[0.0, 1.0, 2.0, 3.0]
"""

from .buffers import AlignedBuffer, BufferPool
from .config import StoreConfig, default_config, load_config
from .errors import (
    AlignmentError,
    BackendIOError,
    BandwidthUnknownError,
    BufferMismatchError,
    CapacityError,
    CheckpointNotFoundError,
    ChecksumError,
    ConfigError,
    InvalidKeyError,
    KeyNotFoundError,
    ManifestError,
    MissingDataError,
    NamespaceInUseError,
    OutOfRangeError,
    PinnedMemoryError,
    ReadOnlyStoreError,
    StoreClosedError,
    StoreLockedError,
    TierStoreError,
    UnsupportedVersionError,
    UnwritablePathError,
)
from .namespaces import NamespaceClaim
from .snapshot import export_hdf5, import_hdf5
from .staging import StagingArea
from .store import ObjectInfo, TierStore
from .tier import Placement, Tier

__version__ = "0.1.0"

__all__ = [
    "AlignedBuffer",
    "AlignmentError",
    "BackendIOError",
    "BandwidthUnknownError",
    "BufferMismatchError",
    "BufferPool",
    "CapacityError",
    "CheckpointNotFoundError",
    "ChecksumError",
    "ConfigError",
    "InvalidKeyError",
    "KeyNotFoundError",
    "ManifestError",
    "MissingDataError",
    "NamespaceClaim",
    "NamespaceInUseError",
    "ObjectInfo",
    "OutOfRangeError",
    "PinnedMemoryError",
    "Placement",
    "ReadOnlyStoreError",
    "StagingArea",
    "StoreClosedError",
    "StoreConfig",
    "StoreLockedError",
    "Tier",
    "TierStore",
    "TierStoreError",
    "UnsupportedVersionError",
    "UnwritablePathError",
    "default_config",
    "export_hdf5",
    "import_hdf5",
    "load_config",
]
