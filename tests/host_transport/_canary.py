# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A struct type that only a sending child process imports: a receiver that
imported modules named by frames would import this one."""

import msgspec


class Canary(msgspec.Struct):
    n: int
