"""QwenVLPixels: equal to Hugging Face's Qwen2-VL image processor over a corpus of sizes,
aspect ratios and image modes made here; a drop-in for the processor; bad input named."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from ascend_vlm.vision_input import QwenVLPixels


@pytest.fixture(scope="module")
def reference():
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448)


def _noise(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    shape = (height, width) if channels == 1 else (height, width, channels)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def _encoded(image: Image.Image, format: str, **options) -> Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **options)
    buffer.seek(0)
    return Image.open(buffer)


def _corpus() -> list:
    rgb = Image.fromarray(_noise(120, 90))
    sixteen_bit = Image.fromarray(_noise(40, 60, 1).astype(np.uint16) * 257)
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE)
    palette.info["transparency"] = 3
    return [
        Image.fromarray(_noise(1, 1)),  # 1x1: grown to the minimum area
        Image.fromarray(_noise(20, 3000, seed=1)),  # very wide (150:1)
        Image.fromarray(_noise(900, 60, seed=2)),  # tall
        Image.fromarray(_noise(448, 448, seed=3)),
        Image.fromarray(_noise(1000, 700, seed=4)),  # above the pixel limit: shrunk
        Image.fromarray(_noise(57, 83, 1, seed=5)),  # grayscale
        Image.fromarray(_noise(64, 48, 4, seed=6)),  # RGBA: transparency onto white
        Image.fromarray(_noise(50, 70, 2, seed=7)),  # LA
        palette,  # palette with a transparent index
        _encoded(rgb.convert("CMYK"), "JPEG"),  # CMYK JPEG
        _encoded(sixteen_bit, "PNG"),  # 16-bit PNG
        _noise(77, 131, seed=8),  # a uint8 HxWxC array
    ]


@pytest.mark.parametrize("workers", [1, 3])
def test_outputs_equal_hugging_faces_over_the_corpus(reference, workers):
    corpus = _corpus()
    expected = reference(images=corpus, return_tensors="pt")
    got = QwenVLPixels(reference, workers=workers)(corpus, return_tensors="pt")
    assert torch.equal(got["image_grid_thw"], expected["image_grid_thw"])
    assert got["pixel_values"].dtype == expected["pixel_values"].dtype == torch.float32
    # Bit for bit: the table holds Hugging Face's own float arithmetic per 8-bit value.
    assert torch.equal(got["pixel_values"], expected["pixel_values"])
    for image in corpus:  # one at a time too
        alone = QwenVLPixels(reference, workers=workers)(image)
        assert torch.equal(
            alone["pixel_values"], reference(images=[image], return_tensors="pt")["pixel_values"]
        )


def test_a_drop_in_for_the_processors_image_part(reference):
    from ascend_vlm.default_model import default_model_path, load_processor

    processor = load_processor(default_model_path())
    content = [{"type": "image"}, {"type": "text", "text": "What colour?"}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    images = [Image.fromarray(_noise(100, 140, seed=9))]
    expected = processor(text=[prompt], images=images, return_tensors="pt")
    processor.image_processor = QwenVLPixels(processor.image_processor)
    got = processor(text=[prompt], images=images, return_tensors="pt")
    assert expected.keys() == got.keys()
    assert all(torch.equal(got[key], expected[key]) for key in expected)


def test_bad_input_is_named(reference):
    pixels = QwenVLPixels(reference, workers=1)
    with pytest.raises(ValueError, match=r"images\[1\]: expected a PIL image or a uint8"):
        pixels([Image.new("RGB", (8, 8)), "a.png"])
    with pytest.raises(ValueError, match=r"images\[0\]: expected a PIL image or a uint8 HxW"):
        pixels([np.zeros((4, 4), dtype=np.float32)])
    with pytest.raises(ValueError, match=r"images\[0\]: absolute aspect ratio must be smaller"):
        pixels([Image.new("RGB", (3000, 10))])
    buffer = io.BytesIO()
    Image.fromarray(_noise(64, 64)).save(buffer, format="PNG")
    truncated = Image.open(io.BytesIO(buffer.getvalue()[:200]))
    with pytest.raises(ValueError, match=r"images\[0\]: cannot read the image"):
        pixels([truncated])
    with pytest.raises(ValueError, match="kwargs: expected none but return_tensors='pt'"):
        pixels([Image.new("RGB", (8, 8))], return_tensors="np")
    with pytest.raises(ValueError, match="workers: expected an int >= 1"):
        QwenVLPixels(reference, workers=0)


def test_a_reference_with_a_step_turned_off_is_refused():
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    with pytest.raises(ValueError, match=r"got \['do_normalize'\] off"):
        QwenVLPixels(Qwen2VLImageProcessorPil(do_normalize=False))
