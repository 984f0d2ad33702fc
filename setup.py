# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Refuse to build: this repository is not a pip-installable package.

The fork is a patch series plus an overlay applied onto an installed, pinned
vLLM 0.32.0, not a distribution of its own. ``pip install .`` used to build an
empty wheel that "succeeded" and installed nothing; it now fails here with the
commands that do install the fork.
"""

import sys

MESSAGE = """\
vllm-rl-fork is not installed with pip: it is a patch series and an overlay
applied onto vLLM 0.32.0.
  In this checkout:   make setup          (creates .venv with the base + fork)
  On a GPU node:      make setup BASE=cuda
  Into an environment that already has vllm==0.32.0: see README.md,
    "Deploying on a GPU node" (python tools/fork.py apply --site-packages DIR)."""

sys.stderr.write(f"error: {MESSAGE}\n")
sys.exit(1)
