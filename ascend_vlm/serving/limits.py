"""What one request may ask of the server, and how long it drains at SIGTERM.

Each limit is a command-line flag of ``python -m ascend_vlm serve`` (:data:`LIMIT_FLAGS`), and
errors that a limit refuses name that flag, so an operator knows what to raise.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from ascend_vlm._byte_units import MIB

# The flag that sets each limit.
LIMIT_FLAGS = {
    "max_body_bytes": "--max-body-mib",
    "max_images": "--max-images",
    "max_image_pixels": "--max-image-pixels",
    "max_completion_tokens": "--max-completion-tokens",
    "max_queue": "--max-queue",
    "url_timeout": "--image-url-timeout",
    "url_max_bytes": "--image-url-max-mib",
    "drain_seconds": "--drain-seconds",
}


@dataclass(frozen=True)
class ServingLimits:
    """Limits of the server (each > 0):

    * ``max_body_bytes``: a request body's size (413 above it);
    * ``max_images``: images in one request; ``max_image_pixels``: width x height of each, read
      from the image's header before its pixels are decoded (400 naming the limit);
    * ``max_completion_tokens``: the most tokens a request may ask for, and what it gets when it
      names none;
    * ``max_queue``: requests waiting or running at once (429 above it);
    * ``url_timeout`` (seconds) and ``url_max_bytes``: an http(s) image fetch, when allowed;
    * ``drain_seconds``: how long SIGTERM lets running requests finish before cancelling them.

    Image sources: data URLs always; http(s) URLs only with ``allow_image_urls``; local files
    only under ``local_images`` (a directory; symlinks resolved, paths outside it refused).
    """

    max_body_bytes: int = 16 * MIB
    max_images: int = 8
    max_image_pixels: int = 4096 * 4096
    max_completion_tokens: int = 512
    max_queue: int = 256
    url_timeout: float = 10.0
    url_max_bytes: int = 16 * MIB
    drain_seconds: float = 30.0
    allow_image_urls: bool = False
    local_images: Path | None = None

    def __post_init__(self) -> None:
        for field in fields(self):
            if field.name not in LIMIT_FLAGS:
                continue
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{field.name}: expected a number > 0, got {value!r}")
        if self.local_images is not None and not Path(self.local_images).is_dir():
            raise ValueError(f"local_images: expected a directory, got {self.local_images}")
