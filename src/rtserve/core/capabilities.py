"""What a backend offers beyond tensors, as typed keys of ``ModelVersion.capabilities``.

The core type stays backend-neutral: a generative version registers its engine under
``GENERATE``; callers ask ``mv.capability(GENERATE)`` (None: a tensor model). A new kind of
offer is one more key here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from rtserve.runtime.llm.engine import LlmEngine

T = TypeVar("T")


class Capability(Generic[T]):
    """A typed key: ``mv.capability(key)`` is a ``T`` or None."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Capability({self.name!r})"


# The generation engine of a ``backend: llm`` version (``core/generation.py`` runs it).
GENERATE: Capability[LlmEngine] = Capability("generate")
