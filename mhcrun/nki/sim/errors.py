"""The one exception the NKI simulator raises for a broken hardware or language rule."""

from __future__ import annotations


class NkiSimError(Exception):
    """A kernel broke an NKI rule: the message names the op, the rule and the shapes/buffers involved."""


class NkiSimUnsupported(NkiSimError, AttributeError):
    """A name of the real ``nki`` API that mhcrun's simulator does not implement (also an AttributeError,
    so ``hasattr(nl, name)`` stays False for it)."""
