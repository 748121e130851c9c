from concurrent.futures import Future
from pathlib import Path

import pytest
from tierstore.backends import Backend, available_backends, backend_class, open_backend, register_backend
from tierstore.backends.dram import DramBackend
from tierstore.backends.nvme import NvmeBackend

from tierstore import ConfigError


def test_builtins_are_found_by_name_and_url(tmp_path: Path) -> None:
    assert {"dram", "nvme"} <= set(available_backends())
    assert backend_class("nvme") is NvmeBackend
    with open_backend("dram://") as backend:
        assert isinstance(backend, DramBackend)
    with open_backend(f"nvme://{tmp_path}?queue_depth=3&chunk_bytes=1MiB") as backend:
        assert isinstance(backend, NvmeBackend)
        assert backend.options.queue_depth == 3 and backend.options.chunk_bytes == 1 << 20
        assert backend.root == tmp_path


def test_register_backend_at_run_time() -> None:
    class EchoBackend(DramBackend):
        scheme = "echo-test"

    register_backend(EchoBackend)
    with open_backend("echo-test://") as backend:
        assert isinstance(backend, EchoBackend)
    with pytest.raises(ConfigError, match="already registered"):
        register_backend(DramBackend, "echo-test")


def test_unknown_scheme_lists_the_available_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown backend 'nope'; available: .*dram.*nvme"):
        open_backend("nope:///x")


def test_spec_of_the_wrong_type() -> None:
    with pytest.raises(ConfigError, match="expected a URL string or a mapping"):
        open_backend(42)  # type: ignore[arg-type]


class NotABackend:
    scheme = "fake"


def test_entry_point_must_name_a_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from tierstore.backends import registry

    monkeypatch.setitem(registry.BUILTIN_BACKENDS, "fake-test", f"{__name__}:NotABackend")
    with pytest.raises(ConfigError, match="is not a tierstore Backend subclass"):
        backend_class("fake-test")
    monkeypatch.setitem(registry.BUILTIN_BACKENDS, "missing-test", "no_such_package_xyz.mod:Cls")
    with pytest.raises(ConfigError, match="needs the package 'no_such_package_xyz'"):
        backend_class("missing-test")


def test_backend_is_abstract() -> None:
    class Incomplete(Backend):
        scheme = "incomplete"

        def _write(self, name: str, offset: int, data: memoryview) -> Future[None]:
            raise AssertionError

    with pytest.raises(TypeError):
        Incomplete.from_options({})


def test_third_party_backend_installed_through_the_entry_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A distribution on sys.path that declares ``[tierstore.backends]`` is usable by URL."""
    (tmp_path / "tiny_backend.py").write_text(
        "from tierstore.backends.dram import DramBackend\n\n"
        "class TinyBackend(DramBackend):\n"
        "    scheme = 'tiny'\n"
    )
    info = tmp_path / "tiny_backend-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiny-backend\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[tierstore.backends]\ntiny = tiny_backend:TinyBackend\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "tiny" in available_backends()
    with open_backend("tiny://") as backend:
        assert type(backend).__name__ == "TinyBackend"
        backend.write("x", 0, b"hi").result()
        assert backend.size("x") == 2
    import torch

    from tierstore import TierStore

    with TierStore.from_config({"tiers": [{"name": "t", "backend": "tiny://"}]}) as store:
        store["k"] = torch.arange(3)
        assert torch.equal(store["k"], torch.arange(3))


def test_optional_backends_by_url(tmp_path: Path) -> None:
    from tierstore.backends.adios2 import Adios2Backend
    from tierstore.backends.zarr import ZarrBackend

    with open_backend(f"zarr+file://{tmp_path / 'z'}") as backend:
        assert isinstance(backend, ZarrBackend) and backend.local_root == tmp_path / "z"
    with open_backend("zarr+memory://bucket/prefix") as backend:
        assert isinstance(backend, ZarrBackend) and backend.local_root is None
        assert not backend.capabilities.persistent
    with open_backend(f"adios2://{tmp_path / 'a'}") as backend:
        assert isinstance(backend, Adios2Backend)


def test_missing_optional_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from tierstore.backends import registry

    monkeypatch.setitem(sys.modules, "zarr", None)  # as if zarr were not installed
    monkeypatch.delitem(sys.modules, "tierstore.backends.zarr", raising=False)
    monkeypatch.delitem(registry._registered, "zarr", raising=False)
    with pytest.raises(ConfigError, match=r"needs the package 'zarr'.*pip install 'tierstore\[zarr\]'"):
        open_backend("zarr+file:///tmp/x")
