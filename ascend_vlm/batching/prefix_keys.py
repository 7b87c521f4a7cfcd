"""The keys of the prefix cache: a chained hash per full KV block of a sequence, as vLLM's and
SGLang's prefix caches key theirs.

Block ``i`` (tokens ``i * block_size`` to ``(i + 1) * block_size - 1``) hashes the previous
block's hash, its token ids and, once the block reaches the prompt's first image token, the
content hash of the prompt's images (:func:`prompt_image_digest`: of every tensor the processor
made beside the token ids and the attention mask, ``pixel_values``, ``image_grid_thw`` ..., or
of the keys of what the processor made of each image). Two sequences share a block's
hash only when their tokens up to its end are equal and, past the first image token, their
images are too; an image placeholder token alone never matches another image. The chain starts
from the sequence's adapter name, as a LoRA adapter changes every layer's KV.
"""

from __future__ import annotations

import torch
import xxhash

# Processor outputs that are per-token text, not image content.
_TEXT_INPUTS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")


def image_digest(inputs: dict[str, torch.Tensor]) -> bytes:
    """A 128-bit content hash of a prompt's image tensors (names, shapes, dtypes and bytes);
    empty when it has none."""
    digest = xxhash.xxh3_128()
    images = sorted(name for name in inputs if name not in _TEXT_INPUTS)
    for name in images:
        tensor = inputs[name].detach().contiguous().cpu()
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.view(torch.uint8).numpy())  # its buffer, not a copy
    return digest.digest() if images else b""


def prompt_image_digest(
    inputs: dict[str, torch.Tensor], image_keys: tuple[bytes, ...] | None
) -> bytes:
    """A 128-bit content hash of a prompt's image tensors ``inputs``, empty without images.
    With ``image_keys`` (:func:`~ascend_vlm.data.content_keys.processed_content_keys`: a key
    of what the processor made of each image, vouched where the image came in) the hash is of
    those keys in order, and no pixel is read; otherwise it is :func:`image_digest`."""
    if not image_keys:
        return image_digest(inputs)
    digest = xxhash.xxh3_128(b"processed images")  # apart from image_digest's tensor names
    for key in image_keys:
        digest.update(len(key).to_bytes(8, "little") + key)
    return digest.digest()


def block_hashes(
    tokens: list[int],
    block_size: int,
    images: bytes,
    first_image: int | None,
    *,
    namespace: bytes = b"",
) -> list[int]:
    """The chained hash of each full block of ``tokens`` (a partial last block has none);
    ``images`` (:func:`prompt_image_digest`) enters every block ending past ``first_image`` (the
    position of the first image token, None without images). ``namespace`` starts the chain:
    what else the KV depends on (the LoRA adapter the sequence runs with), so sequences of
    different namespaces share no block."""
    hashes: list[int] = []
    previous = namespace
    for start in range(0, len(tokens) - block_size + 1, block_size):
        digest = xxhash.xxh3_128(previous)
        digest.update(torch.tensor(tokens[start : start + block_size]).numpy().tobytes())
        if first_image is not None and start + block_size > first_image:
            digest.update(images)
        previous = digest.digest()
        hashes.append(digest.intdigest())
    return hashes
