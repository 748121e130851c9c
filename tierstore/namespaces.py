"""Keys, and the namespaces that keep the workloads sharing one store apart.

Every workload on a store (an offloaded optimizer, an activation offloader, a checkpoint writer)
writes its objects under a key prefix of its own, its *namespace*: ``"<namespace>/<name>"``. Two
workloads writing the same prefix would overwrite each other's objects without any error, so a
workload claims its namespace on the store (`Namespaces.claim`) before its first write, and a second
claim of that namespace, or of one nested in it (``"a"`` and ``"a/b"`` share keys), is refused with
[`NamespaceInUseError`][] naming both owners. A claim lasts until its owner releases it (closing, or
being garbage collected).
"""

from __future__ import annotations

import itertools
import threading
import unicodedata
from dataclasses import dataclass

from .errors import InvalidKeyError, NamespaceInUseError

MAX_KEY_LENGTH = 1024


def check_key(key: object, what: str = "keys") -> str:
    """Return ``key`` if it is a valid key; raise [`InvalidKeyError`][] otherwise.

    Keys never become file names (backend names are generated), but they travel into manifests and
    snapshots, so anything path-like that could escape a root is refused anyway: a key is a
    non-empty string of at most `MAX_KEY_LENGTH` characters, without control characters (Unicode
    category Cc: NUL to US, DEL, and C1 controls such as NEL), a leading ``/`` or a ``..`` segment.
    ``what`` names the thing checked in the message (``"keys"``, ``"namespaces"``).
    """
    if (
        not isinstance(key, str)
        or not key
        or len(key) > MAX_KEY_LENGTH
        or any(unicodedata.category(c) == "Cc" for c in key)
        or key.startswith("/")
        or ".." in key.split("/")
    ):
        raise InvalidKeyError(
            f"{what} are non-empty strings of at most {MAX_KEY_LENGTH} characters, without control "
            f"characters, a leading '/' or a '..' segment; got {key!r}"
        )
    return key


@dataclass(frozen=True, eq=False)
class NamespaceClaim:
    """One workload's hold on a key prefix of a store (compared by identity)."""

    namespace: str
    owner: str
    """Who holds it, as error messages name it (``"OffloadedAdamW"``, ``"ActivationOffload"``)."""

    def key(self, name: str) -> str:
        """The store key of ``name`` in this namespace."""
        return f"{self.namespace}/{name}"


class Namespaces:
    """The namespaces claimed on one store (thread-safe)."""

    def __init__(self) -> None:
        self._claims: dict[str, NamespaceClaim] = {}
        self._lock = threading.Lock()

    def claim(self, namespace: str, owner: str) -> NamespaceClaim:
        """Claim ``namespace`` for ``owner``.

        Raises [`InvalidKeyError`][] for a namespace that is not a valid key (or ends with ``/``),
        and [`NamespaceInUseError`][] if it, a namespace inside it or one containing it is claimed
        already.
        """
        _check_namespace(namespace)
        with self._lock:
            return self._claim(namespace, owner)

    def claim_unique(self, stem: str, owner: str) -> NamespaceClaim:
        """Claim the first free namespace of ``stem``, ``stem-2``, ``stem-3``, ... for ``owner``:
        for workloads whose objects never outlive them (spilled activations), so any name will do
        as long as it is theirs alone."""
        _check_namespace(stem)
        with self._lock:
            for number in itertools.count(1):
                namespace = stem if number == 1 else f"{stem}-{number}"
                if self._holder(namespace) is None:
                    return self._claim(namespace, owner)
        raise AssertionError("unreachable")  # pragma: no cover

    def release(self, claim: NamespaceClaim) -> None:
        """Give ``claim``'s namespace back (a claim released twice, or never held, is ignored)."""
        with self._lock:
            if self._claims.get(claim.namespace) is claim:
                del self._claims[claim.namespace]

    def claimed(self) -> dict[str, str]:
        """Each claimed namespace and its owner."""
        with self._lock:
            return {namespace: claim.owner for namespace, claim in sorted(self._claims.items())}

    def _claim(self, namespace: str, owner: str) -> NamespaceClaim:
        holder = self._holder(namespace)
        if holder is not None:
            raise NamespaceInUseError(
                f"namespace {namespace!r} for {owner} overlaps {holder.namespace!r}, claimed on this "
                f"store by {holder.owner}: two workloads writing the same keys would overwrite each "
                "other; give each its own namespace (the namespace= argument)"
            )
        claim = NamespaceClaim(namespace, owner)
        self._claims[namespace] = claim
        return claim

    def _holder(self, namespace: str) -> NamespaceClaim | None:
        """The claim sharing keys with ``namespace``: the same, an enclosing or a nested one."""
        for held, claim in self._claims.items():
            if held == namespace or namespace.startswith(held + "/") or held.startswith(namespace + "/"):
                return claim
        return None


def _check_namespace(namespace: object) -> None:
    check_key(namespace, "namespaces")
    assert isinstance(namespace, str)
    if namespace.endswith("/"):
        raise InvalidKeyError(
            f"namespaces do not end with '/' (it is added before each name); got {namespace!r}"
        )
