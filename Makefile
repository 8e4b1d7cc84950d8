# fusedloss developer targets
#
#   make test     ruff, then pytest (on a CPU machine Triton kernels run on its interpreter),
#                 all but the tests marked slow
#   make test-slow  the tests marked slow: the longest runs (CI runs both targets)
#   make pytest   pytest only
#   make lint     ruff check
#   make demo     python examples/demo.py (with the demo extra: matplotlib, transformers)
#   make bench    python benchmarks/run.py
#   make clean    remove the virtual environment, caches and build outputs
#
# Python environment
#   By default everything runs in the virtual environment $(VENV) (.venv), created with
#   $(PYTHON) -m venv. torch==$(TORCH_VERSION) is installed into it first and pinned: a pinned
#   torch resolves to the CPU wheel the machine provides, where an unpinned one would pull
#   gigabytes of CUDA packages. Then the package is installed in editable mode with the extra
#   each target needs (test, demo, bench). A stamp file per step skips the install while
#   pyproject.toml is unchanged.
#
#   To use an interpreter that already has everything installed instead (a GPU machine with its
#   own torch and triton, perhaps without a package index), empty VENV: nothing is created or
#   installed, and $(PYTHON) runs everything with the repository root on PYTHONPATH:
#
#       make test PYTHON=python3 VENV=
#
# Other variables
#   TRITON_INTERPRET  1 runs Triton kernels on the CPU interpreter. Default: 0 when nvidia-smi
#                     lists a GPU, else 1.
#   PYTEST_SELECT     test selection, e.g. PYTEST_SELECT='-k "not contrastive"'. Default: empty,
#                     every test (on the interpreter as on a GPU).
#   PYTEST_ARGS       extra pytest arguments, e.g. PYTEST_ARGS="-k clip -x".
#   PYTEST_MARKS      the marker expression of `make pytest`. Default: not slow ('' runs all).
#   PYTEST_WORKERS    pytest-xdist worker processes. Default: auto, one per CPU core (two on
#                     a 2-core machine, where make test's tests took 5.8–7.1 minutes on
#                     2026-11-29); 0 runs every test in the pytest process itself.

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0

ifeq ($(origin TRITON_INTERPRET),undefined)
TRITON_INTERPRET := $(if $(shell nvidia-smi -L 2>/dev/null | grep '^GPU '),0,1)
endif
PYTEST_SELECT ?=
PYTEST_ARGS ?=
PYTEST_WORKERS ?= auto
PYTEST_MARKS ?= not slow

ifneq ($(strip $(VENV)),)
PY := $(VENV)/bin/python
# $(call installed,EXTRA): the stamp proving the package is installed with that extra.
installed = $(VENV)/.installed-$(1)
else
PY := $(PYTHON)
installed =
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
endif

LINT_PATHS := fusedloss tests benchmarks examples

.PHONY: test test-slow pytest lint demo bench clean

test: lint pytest

pytest: $(call installed,test)
	TRITON_INTERPRET=$(TRITON_INTERPRET) $(PY) -m pytest -q -n $(PYTEST_WORKERS) \
		-m "$(PYTEST_MARKS)" $(PYTEST_SELECT) $(PYTEST_ARGS)

test-slow: $(call installed,test)
	TRITON_INTERPRET=$(TRITON_INTERPRET) $(PY) -m pytest -q -n $(PYTEST_WORKERS) \
		-m slow $(PYTEST_SELECT) $(PYTEST_ARGS)

lint: $(call installed,test)
	$(PY) -m ruff check $(LINT_PATHS)

demo: $(call installed,demo)
	TRITON_INTERPRET=$(TRITON_INTERPRET) $(PY) examples/demo.py

bench: $(call installed,bench)
	$(PY) benchmarks/run.py

clean:
	rm -rf $(strip $(VENV)) build dist demo_out .pytest_cache .ruff_cache .hypothesis
	find . -path ./.git -prune -o \( -name __pycache__ -o -name '*.egg-info' \) -prune \
		-exec rm -rf {} +

ifneq ($(strip $(VENV)),)
$(VENV)/.created:
	$(PYTHON) -m venv $(VENV)
	touch $@

$(VENV)/.torch-$(TORCH_VERSION): $(VENV)/.created
	$(PY) -m pip install "torch==$(TORCH_VERSION)"
	touch $@

$(VENV)/.installed-%: pyproject.toml $(VENV)/.torch-$(TORCH_VERSION)
	$(PY) -m pip install -e ".[$*]"
	touch $@

# Stamps are real files, not intermediates to delete after a build.
.PRECIOUS: $(VENV)/.created $(VENV)/.torch-% $(VENV)/.installed-%
endif
