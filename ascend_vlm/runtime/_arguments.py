"""Argument checks shared by the runtime's Python wrappers."""

from __future__ import annotations

from ascend_vlm._errors import AclError

# aclError values raised from Python for arguments AscendCL cannot even express (acl_base.h).
ACL_ERROR_INVALID_PARAM = 100000


def require_int(name: str, value: object) -> int:
    """Return ``value`` if it is an ``int`` (not ``bool``), else raise ``TypeError`` naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    return value


def require_byte_count(name: str, value: object, function: str) -> int:
    """Return a byte count >= 0; a negative one raises ``AclError(ACL_ERROR_INVALID_PARAM)``.

    AscendCL takes sizes as ``size_t``, so a negative size is rejected before the call with the
    code the runtime uses for invalid arguments, and ``function`` names the call it was meant for.
    """
    count = require_int(name, value)
    if count < 0:
        raise AclError(
            ACL_ERROR_INVALID_PARAM,
            "ACL_ERROR_INVALID_PARAM",
            function,
            f"{name}: expected a byte count >= 0, got {count}",
        )
    return count
