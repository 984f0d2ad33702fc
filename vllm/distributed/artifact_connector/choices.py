# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The routed-experts fields of the servers' choices (OpenAI completions and
chat, token-in/token-out generate), defined and set in one place.

Upstream's choices carry ``routed_experts`` (the array, base64 ``.npy``) on
non-streamed responses. The fork adds, through the mixins below, the
reason a choice that ends normally carries none (``routed_experts_error``),
the reference that replaces the array with ``routed_experts_format: "ref"``
(``routed_experts_ref``), and, on streamed choices, the array itself on the
choice's final chunk. A serving module builds a choice with
``**routed_experts_fields(output)`` and sets a stream's final chunk with
:func:`set_final_chunk`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

if TYPE_CHECKING:
    from vllm.outputs import CompletionOutput


class RoutedExpertsChoice(BaseModel):
    """The fork's fields of a choice (see the module docs)."""

    routed_experts_error: str | None = None
    """Why ``routed_experts`` is null although routes were requested, when
    the choice still ends normally (an abort: ``"<ErrorType>: <message>"``)."""

    routed_experts_ref: dict[str, Any] | None = None
    """With ``routed_experts_format: "ref"``: where the routed experts wait,
    instead of ``routed_experts`` (on a stream, on the choice's final
    chunk)."""


class RoutedExpertsStreamChoice(RoutedExpertsChoice):
    """A streamed choice: the fork's fields and the routes themselves, set on
    the choice's final chunk only (the one with ``finish_reason``)."""

    routed_experts: str | None = None
    """The whole request's routed experts, as the non-streamed choice has
    them (base64 ``.npy``)."""


def routed_experts_fields(output: CompletionOutput) -> dict[str, Any]:
    """Keyword arguments of a choice built from ``output``: the error and the
    reference (null when there is none)."""
    ref = output.routed_experts_ref
    return {
        "routed_experts_error": output.routed_experts_error,
        "routed_experts_ref": None if ref is None else ref.to_json(),
    }


def set_final_chunk(
    choice: RoutedExpertsStreamChoice, output: CompletionOutput
) -> None:
    """Set on a stream's final chunk of a choice the routed-experts fields
    that have a value (the rest stay unset, so they are not sent)."""
    from vllm.utils.serial_utils import numpy2base64

    if output.routed_experts is not None:
        choice.routed_experts = numpy2base64(output.routed_experts)
    for name, value in routed_experts_fields(output).items():
        if value is not None:
            setattr(choice, name, value)
