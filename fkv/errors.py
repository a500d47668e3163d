"""The one exception family of fkv.

Every error fkv raises on bad input is an :class:`FkvError` (a ``ValueError``), whose message names
the field, the value received and what is allowed, and a fix where one exists.
"""

from __future__ import annotations

__all__ = ["FkvError", "FkvWireError", "field_error"]


class FkvError(ValueError):
    """Bad input to fkv: the message names the field, the value and what was expected."""


class FkvWireError(FkvError):
    """Peer bytes that fkv refuses to decode (the only error ``decode_untrusted`` raises)."""


def field_error(field: str, value: object, expected: str, fix: str | None = None) -> FkvError:
    """Build the standard message: ``'field' must be <expected> (got <value>)[. fix]``."""
    msg = f"{field!r} must be {expected} (got {value!r})"
    if fix:
        msg += f"; {fix}"
    return FkvError(msg)
