import inspect
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
import torch
from pydantic.fields import FieldInfo
from tierstore.activations import ActivationOffload
from tierstore.activations.options import ActivationOptions
from tierstore.backends.dram import DramBackend, DramOptions
from tierstore.integrations.deepspeed.config import ActivationsSection, TierstoreSection
from tierstore.optimizer import OffloadedAdamW, OffloadedAPOLLO
from tierstore.optimizer.options import StagingOptions

from tierstore import ConfigError, TierStore, UnwritablePathError, default_config, load_config
from tierstore.config import STORE_ARGUMENTS, StoreOptions, parse_byte_size


def nvme_config(path: Path, **cache: object) -> dict[str, object]:
    return {"cache": {"budget": "1MiB", **cache}, "tiers": [{"name": "nvme", "backend": f"nvme://{path}"}]}


def test_dict_json_and_toml_configs_are_equivalent(tmp_path: Path) -> None:
    as_dict = nvme_config(tmp_path / "data", policy="write-through")
    (tmp_path / "c.json").write_text(json.dumps(as_dict))
    (tmp_path / "c.toml").write_text(
        f'[cache]\nbudget = "1MiB"\npolicy = "write-through"\n\n'
        f'[[tiers]]\nname = "nvme"\nbackend = "nvme://{tmp_path / "data"}"\n'
    )
    loaded = [load_config(as_dict), load_config(tmp_path / "c.json"), load_config(str(tmp_path / "c.toml"))]
    assert loaded[0] == loaded[1] == loaded[2]
    assert loaded[0].cache.budget == 1 << 20


def test_store_from_config_file(tmp_path: Path) -> None:
    (tmp_path / "c.json").write_text(json.dumps(nvme_config(tmp_path / "data", policy="write-through")))
    with TierStore.from_config(tmp_path / "c.json") as store:
        store["x"] = torch.arange(5)
        assert store.info("x").tier == "nvme"
        assert len(list((tmp_path / "data").iterdir())) == 1


def test_embedded_default_config_is_valid() -> None:
    config = load_config(default_config())
    assert config.tiers[0].name == "nvme" and config.cache.budget == 256 << 20


def test_backend_given_as_table(tmp_path: Path) -> None:
    config = {
        "tiers": [{"name": "fast", "backend": {"type": "nvme", "path": str(tmp_path), "queue_depth": 2}}]
    }
    with TierStore.from_config(config) as store:
        assert store.tiers[0].backend.options.queue_depth == 2  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({}, r"config\.tiers: Field required"),
        ({"tiers": []}, r"config\.tiers: List should have at least 1 item"),
        ({"tiers": [{"name": "a", "backend": "dram://"}], "cache": {"budget": "lots"}}, r"cache\.budget"),
        (
            {"tiers": [{"name": "a", "backend": "dram://"}], "cache": {"policy": "sometimes"}},
            r"cache\.policy",
        ),
        ({"tiers": [{"name": "a", "backend": "dram://"}], "extra": 1}, r"config\.extra: Extra inputs"),
        ({"tiers": [{"name": "a/b", "backend": "dram://"}]}, r"tiers\.0\.name"),
        ({"tiers": [{"name": "a", "backend": "dram://"}] * 2}, r"tier names must be unique; repeated: a"),
        ({"tiers": [{"name": "a"}]}, r"tiers\.0: Value error, give either 'backend' \(one path\) or 'paths'"),
        (
            {"tiers": [{"name": "a", "backend": "dram://", "paths": [{"backend": "dram://"}]}]},
            r"tiers\.0: .*not both or neither",
        ),
        ({"tiers": [{"name": "a", "paths": []}]}, r"tiers\.0\.paths: List should have at least 1 item"),
        (
            {"tiers": [{"name": "a", "paths": [{"backend": "dram://", "max_reads": 0}]}]},
            r"tiers\.0\.paths\.0\.max_reads",
        ),
        (
            {"tiers": [{"name": "a", "paths": [{"backend": "dram://"}, {"backend": "warp://"}]}]},
            r"unknown backend 'warp'",
        ),
        (
            {"tiers": [{"name": "a", "paths": [{"backend": "nvme:///x?chunk_bytes=3"}]}]},
            r"tiers\.0\.paths\.0\.backend\.chunk_bytes",
        ),
        ({"tiers": [{"name": "a", "backend": "dram://", "placement": "scatter"}]}, r"tiers\.0\.placement"),
        (
            {"tiers": [{"name": "a", "paths": [{"backend": "dram://", "bandwidth": {"read": "fast"}}]}]},
            r"tiers\.0\.paths\.0\.bandwidth\.read",
        ),
        (
            {"tiers": [{"name": "a", "paths": [{"backend": "dram://", "node_limit": {"key": "../x"}}]}]},
            r"tiers\.0\.paths\.0\.node_limit\.key",
        ),
        ({"tiers": [{"name": "a", "backend": "warp:///x"}]}, r"unknown backend 'warp'"),
        (
            {"tiers": [{"name": "a", "backend": "no-scheme"}]},
            r"tiers\.0\.backend: 'no-scheme' is not a backend URL",
        ),
        ({"tiers": [{"name": "a", "backend": {"path": "/x"}}]}, r"tiers\.0\.backend\.type: missing"),
        ({"tiers": [{"name": "a", "backend": "nvme:///x?queue_depth=0"}]}, r"tiers\.0\.backend\.queue_depth"),
        ({"tiers": [{"name": "a", "backend": "dram://?size=3"}]}, r"tiers\.0\.backend\.size: Extra inputs"),
        (
            {"tiers": [{"name": "a", "backend": "zarr+nosuchproto://x"}]},
            r"tiers\.0\.backend: zarr: cannot open url 'nosuchproto://x': Protocol not known",
        ),
    ],
)
def test_invalid_configs_name_the_field(config: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TierStore.from_config(config)


# pydantic alone reads true as 1: one byte, one thread, one request...
BOOLEAN_NUMBERS: dict[str, dict[str, object]] = {
    "cache.budget": {"cache": {"budget": True}},
    "workers": {"workers": True},
    "tiers.0.capacity": {"tiers": [{"name": "a", "backend": "dram://", "capacity": True}]},
    "tiers.0.paths.0.max_reads": {
        "tiers": [{"name": "a", "paths": [{"backend": "dram://", "max_reads": True}]}]
    },
    "tiers.0.paths.0.bandwidth.read": {
        "tiers": [{"name": "a", "paths": [{"backend": "dram://", "bandwidth": {"read": True, "write": 1}}]}]
    },
    "tiers.0.backend.chunk_bytes": {
        "tiers": [{"name": "a", "backend": {"type": "nvme", "path": "/nonexistent", "chunk_bytes": False}}]
    },
    "tiers.0.backend.queue_depth": {
        "tiers": [{"name": "a", "backend": {"type": "nvme", "path": "/nonexistent", "queue_depth": True}}]
    },
}


@pytest.mark.parametrize("field", list(BOOLEAN_NUMBERS))
def test_a_boolean_is_never_a_size_or_count(field: str) -> None:
    config: dict[str, object] = {"tiers": [{"name": "a", "backend": "dram://"}], **BOOLEAN_NUMBERS[field]}
    with pytest.raises(ConfigError, match=re.escape(field) + ": .*not the boolean"):
        TierStore.from_config(config)


def test_a_boolean_size_in_a_toml_file_or_from_python_is_refused(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text('[cache]\nbudget = true\n[[tiers]]\nname = "a"\nbackend = "dram://"\n')
    with pytest.raises(ConfigError, match=r"cache\.budget: .*not the boolean true"):
        load_config(tmp_path / "c.toml")
    with pytest.raises(ConfigError, match="True is not a size"):
        parse_byte_size(True)
    assert parse_byte_size(4096) == 4096 and parse_byte_size("1KiB") == 1024
    # where a field is a bool, a bool is still welcome
    config = {"cache": {"cache_reads": False}, "tiers": [{"name": "a", "backend": "dram://", "adapt": False}]}
    assert not load_config(config).cache.cache_reads


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "bad.toml").write_text("[cache\n")
    with pytest.raises(ConfigError, match="not valid toml"):
        load_config(tmp_path / "bad.toml")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(tmp_path / "list.json")


def test_unwritable_tier_path_closes_already_opened_tiers(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    config = {
        "tiers": [
            {"name": "ok", "backend": f"nvme://{tmp_path / 'ok'}"},
            {"name": "bad", "backend": f"nvme://{tmp_path / 'file' / 'sub'}"},
        ]
    }
    with pytest.raises(UnwritablePathError):
        TierStore.from_config(config)


@pytest.mark.parametrize(
    "backend",
    [
        "dram://",
        "nvme://{root}",
        "zarr+file://{root}?chunk_bytes=64KiB",
        "zarr+memory://{name}",
        "adios2://{root}",
    ],
)
def test_swapping_the_backend_is_one_line(tmp_path: Path, backend: str) -> None:
    """The same document, the same workload; only the tier's backend URL differs."""
    config = {
        "cache": {"budget": "64KiB"},
        "tiers": [{"name": "tier", "backend": backend.format(root=tmp_path / "data", name=tmp_path.name)}],
    }
    tensors = {
        f"k{i}": torch.randn(1000 + 3 * i).to(torch.bfloat16 if i % 2 else torch.float32) for i in range(12)
    }
    with TierStore.from_config(config) as store:
        for key, tensor in tensors.items():
            store[key] = tensor
        store.flush()
        assert store.stats()["tiers"]["tier"]["bytes_written"] > 0
        for key, tensor in tensors.items():
            assert torch.equal(store[key], tensor)


# -- one definition per option: constructors, documents and the DeepSpeed section agree -------------
def keyword_defaults(function: Callable[..., object], names: Iterable[str]) -> dict[str, object]:
    parameters = inspect.signature(function).parameters
    return {name: parameters[name].default for name in names}


def test_the_store_constructor_takes_exactly_the_defined_options_with_their_defaults() -> None:
    parameters = inspect.signature(TierStore.__init__).parameters
    # read_only is how a store is opened (TierStore.from_config takes it too), not a document's option
    assert set(parameters) - {"self", "tiers", "read_only"} == set(STORE_ARGUMENTS)
    assert keyword_defaults(TierStore.__init__, STORE_ARGUMENTS) == StoreOptions().arguments()


@pytest.mark.parametrize("workload", [OffloadedAdamW, OffloadedAPOLLO])
def test_the_optimizers_take_the_staging_options_with_their_defaults(workload: type) -> None:
    defaults = StagingOptions()
    assert keyword_defaults(workload, StagingOptions.model_fields) == dict(defaults)


def test_the_activation_offload_takes_its_options_with_their_defaults() -> None:
    defaults = keyword_defaults(ActivationOffload.__init__, ActivationOptions.model_fields)
    assert ActivationOptions.model_validate(defaults) == ActivationOptions()


def definition(field: FieldInfo) -> tuple[object, ...]:
    return (field.annotation, field.default, field.metadata, field.description)


def test_the_deepspeed_section_reuses_the_definitions() -> None:
    section = TierstoreSection.model_fields
    assert definition(section["workers"]) == definition(StoreOptions.model_fields["workers"])
    for name, field in StagingOptions.model_fields.items():
        assert definition(section[name]) == definition(field)
    assert issubclass(ActivationsSection, ActivationOptions)
    assert ActivationsSection.model_fields.keys() == ActivationOptions.model_fields.keys()


@pytest.mark.parametrize(
    ("argument", "value", "document"),
    [
        ("cache_budget", -1, {"cache": {"budget": -1}}),
        ("cache_budget", True, {"cache": {"budget": True}}),
        ("policy", "sometimes", {"cache": {"policy": "sometimes"}}),
        ("cache_reads", 1, {"cache": {"cache_reads": "maybe"}}),
        ("pack_below", "lots", {"cache": {"pack_below": "lots"}}),
        ("workers", 0, {"workers": 0}),
        ("workers", 2.5, {"workers": 2.5}),
        ("workers", "4", {"workers": "4"}),
        ("verify", "never", {"verify": "never"}),
        ("memory_budget", 1024, {"memory_budget": 1024}),
    ],
)
def test_constructor_and_document_refuse_the_same_option(
    argument: str, value: object, document: dict[str, object]
) -> None:
    """The constructor names its keyword, the document its key; both come from one field."""
    backend = DramBackend(DramOptions())
    with pytest.raises(ConfigError, match=rf"^{argument}: must be "):
        TierStore([backend], **{argument: value})  # type: ignore[arg-type]
    key = ".".join(STORE_ARGUMENTS[argument])
    with pytest.raises(ConfigError, match=rf"config\.{re.escape(key)}: "):
        load_config({"tiers": [{"name": "a", "backend": "dram://"}], **document})
    backend.close()


def test_a_size_is_text_in_a_document_and_an_integer_from_python() -> None:
    assert load_config({"cache": {"budget": "1MiB"}, "tiers": [{"name": "a", "backend": "dram://"}]})
    for text in ("1MiB", 1.5e6, 2.0):
        with pytest.raises(ConfigError, match=r"^cache_budget: must be a number of bytes >= 0, not "):
            TierStore([DramBackend(DramOptions())], cache_budget=text)  # type: ignore[arg-type]


def test_from_config_passes_every_option_to_the_store(tmp_path: Path) -> None:
    document = {
        "cache": {"budget": "2MiB", "policy": "write-through", "cache_reads": False, "pack_below": 0},
        "workers": 2,
        "manifest": str(tmp_path / "manifest"),
        "verify": "sampled",
        "memory_budget": "8MiB",
        "tiers": [{"name": "a", "backend": f"nvme://{tmp_path / 'data'}"}],
    }
    with TierStore.from_config(document) as store:
        assert (store.policy, store.cache_reads, store.verify, store.pack_below) == (
            "write-through",
            False,
            "sampled",
            0,
        )
        assert store.stats()["memory"] == {"budget_bytes": 8 << 20, "reserved_bytes": {"cache": 2 << 20}}
