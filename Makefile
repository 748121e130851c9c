# Two commands do all set-up on a fresh machine: `make demo` (main job) and `make test`.
# Each creates .venv, installs torch first, then tierstore in editable mode. tools/install-torch
# picks the torch: one already installed is kept; else the CUDA build where nvidia-smi runs, the CPU
# build elsewhere (a bare torch requirement would pull a multi-GB CUDA build on any machine).
# TORCH_VARIANT=cpu|cuda overrides the choice, TORCH_INDEX adds an index to take torch from,
# TORCH_VERSION names the release.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
TORCH_VARIANT ?=
TORCH_INDEX ?=

.PHONY: demo test lint docs bench showcase clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	TORCH_VERSION='$(TORCH_VERSION)' TORCH_VARIANT='$(TORCH_VARIANT)' TORCH_INDEX='$(TORCH_INDEX)' \
		tools/install-torch $(BIN)/python
	touch $@

$(VENV)/.runtime: pyproject.toml setup.py $(VENV)/.torch
	$(BIN)/pip install -e .
	touch $@

# apollo-torch is the tests' oracle for OffloadedAPOLLO, not a dependency (CC-BY-NC; it requires
# transformers and bitsandbytes for optimizers the tests never load): no deps, pinned.
$(VENV)/.test: pyproject.toml setup.py $(VENV)/.torch
	$(BIN)/pip install -e '.[test]'
	$(BIN)/pip install --no-deps 'apollo-torch==1.0.3'
	touch $@

demo: $(VENV)/.runtime
	$(BIN)/tierstore train

test: $(VENV)/.test
	$(BIN)/python -m pytest

# ruff (lint and format) and strict mypy over the whole tree. mypy cannot follow the package-dir
# mapping (backends/ is tierstore.backends, ...): it would take those imports for missing modules
# and type them Any. So it checks a tree of links laid out as the installed package.
TYPED_TREE := .mypy-tree
lint: $(VENV)/.test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	rm -rf $(TYPED_TREE) && mkdir -p $(TYPED_TREE)/tierstore
	ln -s $(CURDIR)/tierstore/* $(TYPED_TREE)/tierstore/
	ln -s $(CURDIR)/tests $(CURDIR)/benchmarks $(CURDIR)/tools $(TYPED_TREE)/
	for package in backends optimizer activations checkpoint integrations; do \
		ln -s $(CURDIR)/$$package $(TYPED_TREE)/tierstore/$$package; done
	cd $(TYPED_TREE) && $(abspath $(BIN))/mypy --config-file $(CURDIR)/pyproject.toml tierstore tests benchmarks tools

# Benchmarks need fio, and DeepSpeed's baseline libaio-dev (Debian packages); run as root so they
# can be installed and caches dropped. Never part of `make test`.
$(VENV)/.bench: $(VENV)/.test
	command -v fio >/dev/null && dpkg -s libaio-dev >/dev/null 2>&1 || \
		(apt-get update && apt-get install -y fio libaio-dev)
	$(BIN)/pip install py-spy
	touch $@

# Every benchmark whose figures the README or the docs quote, then those figures rewritten from the
# new JSON (benchmarks.figures; tests/test_docs_figures.py checks each command is here). Hours:
# the optimizer runs move tens of GB, and the last is the showcase below.
bench: $(VENV)/.bench
	$(BIN)/python -m benchmarks.bench_nvme --output benchmarks/results/nvme.json
	$(BIN)/python -m benchmarks.bench_backends --output benchmarks/results/backends.json
	$(BIN)/python -m benchmarks.bench_virtual_tier --output benchmarks/results/virtual_tier.json
	$(BIN)/python -m benchmarks.bench_optimizer --repeats 5 --profile --output benchmarks/results/optimizer.json
	$(BIN)/python -m benchmarks.bench_optimizer --budget 4GiB --sizes 1GiB,4GiB,16GiB,32GiB --steps 3 \
		--output benchmarks/results/optimizer_scale.json
	$(BIN)/python -m benchmarks.predict_mlp_offload --output benchmarks/results/mlp_offload_prediction.json
	$(BIN)/python -m benchmarks.bench_apollo --output benchmarks/results/apollo.json
	$(BIN)/python -m benchmarks.quality_apollo --output benchmarks/results/apollo_quality.json \
		--plot benchmarks/results/apollo_quality.png
	$(BIN)/python -m benchmarks.bench_state_precision --output benchmarks/results/state_precision.json
	$(BIN)/python -m benchmarks.quality_state_precision --output benchmarks/results/state_precision_quality.json \
		--plot benchmarks/results/state_precision_quality.png
	$(BIN)/python -m benchmarks.bench_deepspeed --steps 5 --repeats 3 --output benchmarks/results/deepspeed.json
	$(BIN)/python -m benchmarks.bench_activations --repeats 3 --output benchmarks/results/activations.json
	RFS_SIZE=12G ../shared/tools/remote-tier.sh start
	$(BIN)/python -m benchmarks.bench_checkpoint --repeats 3 --remote-mount /tmp/tierstore-remote/mnt \
		--output benchmarks/results/checkpoint.json
	../shared/tools/remote-tier.sh stop
	$(BIN)/python -m benchmarks.bench_checkpoint_open --output benchmarks/results/checkpoint_open.json
	$(BIN)/python -m benchmarks.bench_scale --dir /dev/shm/bench-scale --output benchmarks/results/scale.json
	$(BIN)/python -m benchmarks.bench_fsdp --output benchmarks/results/fsdp.json
	$(BIN)/python -m benchmarks.bench_beyond_memory --save-steps 3 --plot benchmarks/results/beyond_memory.png \
		--output benchmarks/results/beyond_memory.json
	$(BIN)/python -m benchmarks.figures README.md docs/performance.md docs/fsdp.md

# The documentation site (mkdocs.yml, docs/) into site/, strictly: a broken link, a missing reference
# or a docstring warning fails the build. Its tools are the docs extra, installed here only.
$(VENV)/.docs: pyproject.toml setup.py $(VENV)/.torch
	$(BIN)/pip install -e '.[docs]'
	touch $@

docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# A ~1B-parameter Llama trained by Trainer beyond this machine's memory: tierstore beside DeepSpeed
# (about 25 minutes; needs ~50 GB free on the disk under test).
showcase: $(VENV)/.bench
	$(BIN)/python -m benchmarks.bench_beyond_memory --save-steps 3 \
		--plot benchmarks/results/beyond_memory.png --output benchmarks/results/beyond_memory.json

clean:
	rm -rf $(VENV) *.egg-info tierstore-data bench-data $(TYPED_TREE) site build/docs-tree $(GPU_BUNDLE)

# The GPU check's bundle (docs/development.md, "GPU check"): tierstore's wheel, the wheels of the
# runtime needs a GPU node lacks (for its Python: GPU_PYTHON), the tests, the GPU benchmarks and the
# runner, for a node without a package index: there, `python3 .gpu-bundle/run.py`.
GPU_BUNDLE := .gpu-bundle
GPU_PYTHON ?= 3.12
.PHONY: gpu-bundle
gpu-bundle: $(VENV)/.test
	$(BIN)/python tools/gpu_check.py --out $(GPU_BUNDLE) --python-version $(GPU_PYTHON)
