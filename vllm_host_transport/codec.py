# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The tensor-frame codec: one object that encodes payloads into frames and
decodes frames into owned objects.

The wire format is in :mod:`.frame`, encoding in :mod:`.encode`, decoding in
:mod:`.decode` (and vLLM's serializer for ``KIND_SERIAL`` frames in
:mod:`.serial`). :class:`FrameCodec` is both sides in one: what the connector
and a trainer use. A decoding failure raises :class:`CorruptFrame`, which a
trainer that decodes frames itself imports from here with the codec.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from vllm_host_transport.decode import FrameDecoder
from vllm_host_transport.encode import FrameEncoder
from vllm_host_transport.frame import CorruptFrame

__all__ = ["CorruptFrame", "FrameCodec"]


class FrameCodec(FrameEncoder, FrameDecoder):
    """Encodes payloads into frames and decodes frames into owned objects.

    Not thread-safe: a connector keeps one codec for sending and one for
    receiving, each used under its own lock.
    """

    def __init__(
        self,
        max_payload_bytes: int,
        large_leaf_bytes: int,
        struct_types: Sequence[type[msgspec.Struct]] = (),
    ) -> None:
        FrameEncoder.__init__(self, max_payload_bytes, large_leaf_bytes)
        FrameDecoder.__init__(self, struct_types)
