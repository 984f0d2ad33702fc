# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Packaging stub.

The fork is not a distribution of its own: it is a patch series plus an overlay
applied onto an installed, pinned vLLM 0.32.0 (``make setup`` locally, or
``python tools/fork.py apply --site-packages DIR`` on a node that already has
the base). This stub only lets tools that expect ``setup.py`` read the metadata
in ``pyproject.toml``; it installs no packages.
"""

from setuptools import setup

setup(packages=[])
