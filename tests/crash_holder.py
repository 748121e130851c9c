"""Child process of the leftover tests: opens a store, writes, and waits to be killed with ``kill -9``.

    python tests/crash_holder.py CONFIG_JSON MODE

``loop``: prints "ready", then overwrites 4 keys with 16 MiB tensors until killed, so a kill lands
in the middle of a put, with recycled files set aside. ``start``: prints "ready" just before the
first put, which starts the backends' worker processes (ADIOS2), then waits.
"""

import json
import sys
import threading
from itertools import count

import torch

from tierstore import TierStore


def main() -> None:
    config, mode = json.loads(sys.argv[1]), sys.argv[2]
    with TierStore.from_config(config) as store:
        print("ready", flush=True)
        if mode == "start":
            store.put("first", torch.ones(1000), cache=False).result()
            threading.Event().wait()
        for version in count():
            store.put(
                f"k{version % 4}", torch.full((4 << 20,), version, dtype=torch.int32), cache=False
            ).result()


if __name__ == "__main__":
    main()
