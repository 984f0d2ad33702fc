# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Fixtures for the artifact connector tests.

Every test that touches /dev/shm gets its own root ``/dev/shm/vart-test-*``
and the root is removed afterwards; a session check asserts that nothing
with that prefix is left behind.
"""

import os
import shutil
import sys
import uuid

import pytest

SHM_PREFIX = "vart-test-"
CHILD = os.path.join(os.path.dirname(__file__), "shm_child.py")


@pytest.fixture
def shm_root():
    root = f"/dev/shm/{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _nothing_left_in_dev_shm():
    yield
    left = [n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX)]
    ours = [n for n in left if n.startswith(f"{SHM_PREFIX}{os.getpid()}-")]
    assert not ours, f"artifact tests left {ours} in /dev/shm"


@pytest.fixture
def child_cmd():
    """Command prefix that runs tests/artifact_connector/shm_child.py in a
    fresh interpreter."""
    return [sys.executable, CHILD]
