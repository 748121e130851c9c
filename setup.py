"""Only what pyproject.toml cannot say: ship ``tierstore-deepspeed.pth`` (the start-up line of
``TIERSTORE_DEEPSPEED=1``, see ``integrations/deepspeed/hook.py``) and ``tierstore-activations.pth``
(that of ``TIERSTORE_ACTIVATIONS``, see ``integrations/huggingface.py``) at the top of
site-packages, in wheels (``build_py``) and in editable installs (``editable_wheel``, which skips
``build_py``'s extra files)."""

from pathlib import Path
from typing import Any, Self

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

INTEGRATIONS = Path(__file__).parent / "integrations"
PTHS = (INTEGRATIONS / "deepspeed" / "tierstore-deepspeed.pth", INTEGRATIONS / "tierstore-activations.pth")


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        Path(self.build_lib).mkdir(parents=True, exist_ok=True)
        for pth in PTHS:
            (Path(self.build_lib) / pth.name).write_bytes(pth.read_bytes())

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [
            *super().get_outputs(include_bytecode),
            *(str(Path(self.build_lib) / pth.name) for pth in PTHS),
        ]


class EditableWithPth(editable_wheel):
    def _select_strategy(self, *args: Any, **kwargs: Any) -> Any:
        return _WithPth(super()._select_strategy(*args, **kwargs))


class _WithPth:
    """The editable strategy (a context manager called with the wheel), adding the .pth files."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def __call__(self, wheel: Any, files: Any, mapping: Any) -> None:
        self.strategy(wheel, files, mapping)
        for pth in PTHS:
            wheel.writestr(pth.name, pth.read_bytes())

    def __enter__(self) -> Self:
        self.strategy.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.strategy.__exit__(*exc)


setup(cmdclass={"build_py": BuildWithPth, "editable_wheel": EditableWithPth})
