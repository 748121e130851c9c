import importlib.util
import inspect
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Unpack, get_type_hints

import pytest
import torch
from pydantic.fields import FieldInfo
from tierstore.activations import ActivationOffload
from tierstore.activations.options import ActivationOptions
from tierstore.backends.dram import DramBackend, DramOptions
from tierstore.backends.registry import BUILTIN_BACKENDS, backend_class
from tierstore.integrations.deepspeed.config import ActivationsSection, TierstoreSection, parse_section
from tierstore.integrations.fsdp import FSDPOffloadedAdamW
from tierstore.optimizer import OffloadedAdamW, OffloadedAPOLLO
from tierstore.optimizer.adamw import AdamWKeywords
from tierstore.optimizer.options import OptimizerOptions, StagingKeywords, StagingOptions, optimizer_options

from tierstore import ConfigError, Tier, TierStore, UnwritablePathError, default_config, load_config
from tierstore._checks import ConfigModel
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
    with pytest.raises(ConfigError, match=r"^must be a number of bytes >= 0 .*, not True$"):
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


def test_the_staging_keywords_are_the_optimizer_options() -> None:
    """The typed keywords and the definitions name the same options (the DeepSpeed section's
    among them)."""
    assert get_type_hints(StagingKeywords).keys() == OptimizerOptions.model_fields.keys()
    assert StagingOptions.model_fields.keys() <= OptimizerOptions.model_fields.keys()


@pytest.mark.parametrize("workload", [OffloadedAdamW, OffloadedAPOLLO])
def test_the_optimizers_take_the_staging_options_defined_once(
    workload: type[OffloadedAdamW] | type[OffloadedAPOLLO],
) -> None:
    """No option restated in a signature: the staging keywords are ``**staging``, and an optimizer
    given none holds the definitions' defaults."""
    parameters = inspect.signature(workload).parameters
    assert not parameters.keys() & OptimizerOptions.model_fields.keys()
    assert get_type_hints(workload.__init__)["staging"] == Unpack[StagingKeywords]
    with TierStore([DramBackend(DramOptions())], cache_budget=0) as store:
        optimizer = workload(torch.nn.Linear(4, 4).parameters(), store)
        assert optimizer.options == OptimizerOptions()
        optimizer.close()


def test_fsdp_passes_the_adamw_keywords_on() -> None:
    """FSDPOffloadedAdamW takes its own arguments and OffloadedAdamW's others, typed by
    AdamWKeywords: OffloadedAdamW's keywords but ``namespace``, with their annotations."""
    own = get_type_hints(OffloadedAdamW.__init__)
    keywords = {
        name: own[name]
        for name, parameter in inspect.signature(OffloadedAdamW).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name != "namespace"
    }
    assert get_type_hints(AdamWKeywords) == keywords | get_type_hints(StagingKeywords)
    assert get_type_hints(FSDPOffloadedAdamW.__init__)["options"] == Unpack[AdamWKeywords]
    assert set(inspect.signature(FSDPOffloadedAdamW).parameters) == {
        "params",
        "store",
        "namespace",
        "process_group",
        "options",
    }


@pytest.mark.parametrize("workload", [OffloadedAdamW, OffloadedAPOLLO])
def test_a_keyword_that_is_no_option_is_a_type_error(
    workload: type[OffloadedAdamW] | type[OffloadedAPOLLO],
) -> None:
    """As Python's own for a misspelt keyword, not an option silently ignored."""
    unexpected = rf"^{workload.__name__}\(\) got an unexpected keyword argument 'budget'$"
    with (
        TierStore([DramBackend(DramOptions())], cache_budget=0) as store,
        pytest.raises(TypeError, match=unexpected),
    ):
        workload(torch.nn.Linear(4, 4).parameters(), store, budget=1 << 20)  # type: ignore[call-arg]


def test_the_activation_offload_takes_its_options_with_their_defaults() -> None:
    defaults = keyword_defaults(ActivationOffload.__init__, ActivationOptions.model_fields)
    assert ActivationOptions.model_validate(defaults) == ActivationOptions()


def definition(field: FieldInfo) -> tuple[object, ...]:
    return (field.annotation, field.default, field.metadata, field.description)


def test_the_deepspeed_section_reuses_the_definitions() -> None:
    section = TierstoreSection.model_fields
    assert definition(section["workers"]) == definition(StoreOptions.model_fields["workers"])
    precision = OptimizerOptions.model_fields["state_precision"]
    assert definition(section["state_precision"]) == definition(precision)
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


SIZE_REFUSED = r"must be a number of bytes >= \d+ \(an integer or text such as '64MiB'\), not "
"""What every size in bytes says when it is refused, whoever takes it (its least value: 0, or a
larger bound of its own)."""


def on_a_store(make: Callable[[TierStore, Any], Any]) -> Callable[[Any, Path], object]:
    """A size given to something made on a store (a workload, a staging area), closed after."""

    def use(value: Any, tmp_path: Path) -> None:
        with TierStore([DramBackend(DramOptions())], cache_budget=0) as store:
            make(store, value).close()

    return use


def opened(document: dict[str, Any]) -> None:
    """A document whose tiers must be opened for their backends' options to be checked."""
    TierStore.from_config({"cache": {"budget": 0}, **document}).close()


def on_a_tier(field: str, backend: Callable[[Path], dict[str, Any]]) -> Callable[[Any, Path], object]:
    """A size in the table of a tier's backend."""
    return lambda value, tmp_path: opened(
        {"tiers": [{"name": "a", "backend": {**backend(tmp_path), field: value}}]}
    )


def dram_tier(**fields: Any) -> dict[str, Any]:
    return {"tiers": [{"name": "a", "backend": "dram://", **fields}]}


def bandwidth(value: Any) -> dict[str, Any]:
    return {
        "tiers": [
            {"name": "a", "paths": [{"backend": "dram://", "bandwidth": {"read": value, "write": value}}]}
        ]
    }


PYTHON_SIZES: dict[str, tuple[str, Callable[[Any, Path], object]]] = {
    # case: (the argument the error names, a use of the value)
    "TierStore cache_budget": (
        "cache_budget",
        lambda v, _: TierStore([DramBackend(DramOptions())], cache_budget=v).close(),
    ),
    "TierStore pack_below": (
        "pack_below",
        lambda v, _: TierStore([DramBackend(DramOptions())], pack_below=v).close(),
    ),
    "TierStore memory_budget": (
        "memory_budget",
        lambda v, _: TierStore([DramBackend(DramOptions())], cache_budget=0, memory_budget=v).close(),
    ),
    "TierStore.staging budget": ("owner: budget", on_a_store(lambda store, v: store.staging("owner", v))),
    "TierStore.staging pool_bytes": (
        "pool_bytes",
        on_a_store(lambda store, v: store.staging("owner", "64MiB", pool_bytes=v)),
    ),
    "OffloadedAdamW dram_budget": (
        "dram_budget",
        on_a_store(lambda store, v: OffloadedAdamW(torch.nn.Linear(4, 4).parameters(), store, dram_budget=v)),
    ),
    "OffloadedAPOLLO dram_budget": (
        "dram_budget",
        on_a_store(
            lambda store, v: OffloadedAPOLLO(torch.nn.Linear(4, 4).parameters(), store, dram_budget=v)
        ),
    ),
    "ActivationOffload budget": ("budget", on_a_store(lambda store, v: ActivationOffload(store, budget=v))),
    "ActivationOffload min_bytes": (
        "min_bytes",
        on_a_store(lambda store, v: ActivationOffload(store, min_bytes=v)),
    ),
    "ActivationOffload device_budget": (
        "device_budget",
        on_a_store(lambda store, v: ActivationOffload(store, device_budget=v)),
    ),
}
"""Every size in bytes a public class or function takes from Python."""

DOCUMENT_SIZES: dict[str, tuple[str, Callable[[Any, Path], object]]] = {
    # the option's definition (model.field): (the key the error names, a document holding the value)
    "CacheConfig.budget": ("cache.budget", lambda v, _: opened({"cache": {"budget": v}, **dram_tier()})),
    "CacheConfig.pack_below": (
        "cache.pack_below",
        lambda v, _: opened({"cache": {"pack_below": v}, **dram_tier()}),
    ),
    "StoreOptions.memory_budget": ("memory_budget", lambda v, _: opened({"memory_budget": v, **dram_tier()})),
    "TierConfig.capacity": ("tiers.0.capacity", lambda v, _: opened(dram_tier(capacity=v))),
    "BandwidthConfig.read": ("tiers.0.paths.0.bandwidth.read", lambda v, _: opened(bandwidth(v))),
    "BandwidthConfig.write": ("tiers.0.paths.0.bandwidth.write", lambda v, _: opened(bandwidth(v))),
    "NvmeOptions.chunk_bytes": (
        "tiers.0.backend.chunk_bytes",
        on_a_tier("chunk_bytes", lambda tmp_path: {"type": "nvme", "path": str(tmp_path / "nvme")}),
    ),
    "ZarrOptions.chunk_bytes": (
        "tiers.0.backend.chunk_bytes",
        on_a_tier("chunk_bytes", lambda tmp_path: {"type": "zarr", "url": str(tmp_path / "zarr")}),
    ),
    "Adios2Options.transfer_bytes": (
        "tiers.0.backend.transfer_bytes",
        on_a_tier("transfer_bytes", lambda tmp_path: {"type": "adios2", "path": str(tmp_path / "adios2")}),
    ),
    "ThrottleOptions.read_bytes_per_s": (
        "tiers.0.backend.read_bytes_per_s",
        on_a_tier("read_bytes_per_s", lambda _: {"type": "throttle", "inner": "dram://"}),
    ),
    "ThrottleOptions.write_bytes_per_s": (
        "tiers.0.backend.write_bytes_per_s",
        on_a_tier("write_bytes_per_s", lambda _: {"type": "throttle", "inner": "dram://"}),
    ),
    "ThrottleOptions.piece_bytes": (
        "tiers.0.backend.piece_bytes",
        on_a_tier("piece_bytes", lambda _: {"type": "throttle", "inner": "dram://"}),
    ),
    "StagingOptions.dram_budget": (
        "tierstore.dram_budget",
        lambda v, _: parse_section({"tierstore": {"dram_budget": v}}),
    ),
    "ActivationOptions.budget": (
        "tierstore.activations.budget",
        lambda v, _: parse_section({"tierstore": {"activations": {"budget": v}}}),
    ),
    "ActivationOptions.min_bytes": (
        "tierstore.activations.min_bytes",
        lambda v, _: parse_section({"tierstore": {"activations": {"min_bytes": v}}}),
    ),
    "ActivationOptions.device_budget": (
        "tierstore.activations.device_budget",
        lambda v, _: parse_section({"tierstore": {"activations": {"device_budget": v}}}),
    ),
}
"""Every size in bytes of a configuration document (a store's, a backend's table, the DeepSpeed
config's section), by the option model's field that defines it."""

KEYWORD_SIZES: dict[str, tuple[str, Callable[[Any, Path], object]]] = {
    # the option's definition (model.field): (the argument the error names, a check through it)
    "TierOptions.capacity": (
        "capacity",
        lambda v, _: Tier("a", DramBackend(DramOptions()), capacity=v).close(),
    ),
    "OptimizerOptions.gpu_budget": (
        "gpu_budget",
        lambda v, _: optimizer_options("OffloadedAdamW", {"gpu_budget": v}),
    ),
}
"""Every size in bytes of a model checking keyword arguments (an option no document takes, or a
document's option taken from Python by a class of its own, as Tier's capacity), checked through
its definition as the class taking it checks it."""

OPTIONAL_PACKAGES = {"ZarrOptions": "zarr", "Adios2Options": "adios2"}


def size_cases() -> list[Any]:
    cases = []
    for source in (PYTHON_SIZES, DOCUMENT_SIZES, KEYWORD_SIZES):
        for case, (name, use) in source.items():
            package = OPTIONAL_PACKAGES.get(case.split(".")[0])
            missing = package is not None and importlib.util.find_spec(package) is None
            skip = pytest.mark.skipif(missing, reason=f"needs {package}")
            cases.append(pytest.param(name, use, id=case, marks=skip))
    return cases


@pytest.mark.parametrize(("name", "use"), size_cases())
def test_every_size_in_bytes_follows_one_rule(
    name: str, use: Callable[[Any, Path], object], tmp_path: Path
) -> None:
    """From Python and in a document alike, a size is an integer or text such as "64MiB"; a
    negative size or text that is no size is refused with one message naming the argument or
    the key."""
    use("64MiB", tmp_path)
    use(64 << 20, tmp_path)
    for value in (-1, "-1MiB", "lots"):
        with pytest.raises(
            ConfigError, match=rf"\b{re.escape(name)}:? {SIZE_REFUSED}{re.escape(repr(value))}(;|$)"
        ):
            use(value, tmp_path)


def test_every_size_option_is_in_the_rule_test() -> None:
    """A size in bytes added to any option model is added to the test above, which shows that it
    follows the one rule."""
    for name in BUILTIN_BACKENDS:
        backend_class(name)  # the backends' option models
    defined = set()
    for model in all_subclasses(ConfigModel):
        for field, info in model.model_fields.items():
            if "ByteSize" in str(info.annotation):
                owner = next(
                    base for base in reversed(model.__mro__) if field in getattr(base, "__annotations__", {})
                )
                defined.add(f"{owner.__name__}.{field}")
    assert defined == set(DOCUMENT_SIZES) | set(KEYWORD_SIZES)


def all_subclasses(model: type[ConfigModel]) -> set[type[ConfigModel]]:
    found: set[type[ConfigModel]] = set(model.__subclasses__())
    return found.union(*(all_subclasses(sub) for sub in found))


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
