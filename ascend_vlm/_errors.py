"""Exceptions of the public API."""

from __future__ import annotations


class AclError(RuntimeError):
    """An AscendCL call returned an error.

    Attributes:
        code: the ``aclError`` value the runtime returned (e.g. 107000).
        name: the symbolic name of that code (e.g. ``"ACL_ERROR_RT_PARAM_INVALID"``).
        function: the AscendCL function that failed (e.g. ``"aclrtFree"``).
    """

    def __init__(self, code: int, name: str, function: str, detail: str = "") -> None:
        self.code = int(code)
        self.name = name
        self.function = function
        self.detail = detail
        message = f"{function} failed with {name} ({code})"
        super().__init__(f"{message}: {detail}" if detail else message)

    def __reduce__(self):
        return (type(self), (self.code, self.name, self.function, self.detail))


class PatchError(RuntimeError):
    """``ascend_vlm.patch`` cannot patch the given model (unsupported family or version)."""
