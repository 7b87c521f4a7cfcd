"""The transformers versions `ascend_vlm.patch` is tested against.

`patch` depends on transformers internals (attention/mask interfaces, module class names, the
module-level RoPE functions), so versions outside the tested range are refused, not guessed at.
"""

from __future__ import annotations

from ascend_vlm._errors import PatchError

TESTED_TRANSFORMERS = ((5, 23), (5, 24))  # >=5.23, <5.24


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def check_transformers_version(version: str | None = None) -> str:
    """Return the installed transformers version, or raise PatchError when it is untested.

    `version` overrides the installed one (for tests).
    """
    if version is None:
        import transformers

        version = transformers.__version__
    lowest, above = TESTED_TRANSFORMERS
    if not lowest <= _major_minor(version) < above:
        raise PatchError(
            f"transformers {version} is outside the range ascend_vlm.patch is tested with "
            f"(>={lowest[0]}.{lowest[1]},<{above[0]}.{above[1]}); install transformers=="
            f"{lowest[0]}.{lowest[1]}.* or use an ascend_vlm release made for your version"
        )
    return version
