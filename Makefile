# The README's two commands: `make demo` and `make test`. Both set up first
# (scripts/setup.sh: .venv, pinned deps, msg/srv interfaces; fast when done).
#
# Python runs from .venv with the repo first on PYTHONPATH: the sources are
# used in place, and embodied_kv/__init__.py joins them with the generated
# embodied_kv.msg / embodied_kv.srv installed in the venv.

SHELL := bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.embodied_kv-setup
RUN := PYTHONPATH=$(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH)) $(PY)
DEMO_SECONDS ?= 20
PYTEST_ARGS ?=

.PHONY: demo test lint pytest setup clean distclean gpu-check gpu-check-mechanisms

demo: $(STAMP)
	$(RUN) -m embodied_kv.cli demo --seconds $(DEMO_SECONDS)

test: lint pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .

pytest: $(STAMP)
	$(RUN) -m pytest -q $(PYTEST_ARGS)

setup: $(STAMP)

# On a machine with CUDA (no setup, no ROS: the machine's own torch), < 8 minutes:
# action latency at pi05 with its breakdown, top kernels and LeRobot's PI05Policy beside
# it, Triton registers / spills, the CUDA tests of the action path (docs/gpu.md); results
# under bench/results/<date>-<gpu>/. Without CUDA it stops with a one-line explanation.
# GPU_CHECK_ARGS="--profile full" is the whole test suite and the latency benches.
GPU_CHECK_ARGS ?=
gpu-check:
	scripts/gpu_check.sh $(GPU_CHECK_ARGS)

# every seed's mechanism at pi05 on one GPU, < 8 min (docs/gpu_mechanisms.md)
gpu-check-mechanisms:
	scripts/gpu_check.sh --profile mechanisms $(GPU_CHECK_ARGS)

$(STAMP): scripts/setup.sh requirements.lock requirements-nodeps.lock CMakeLists.txt package.xml $(wildcard msg/*.msg srv/*.srv action/*.action)
	scripts/setup.sh
	@touch $@

clean:
	rm -rf build .pytest_cache .ruff_cache

distclean: clean
	rm -rf $(VENV)
