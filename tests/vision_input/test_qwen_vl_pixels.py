"""QwenVLPixels: equal to Hugging Face's Qwen2-VL image processor over a corpus of sizes,
aspect ratios and image modes made here; a drop-in for the processor; bad input named."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from image_corpus import corpus, noise, saved_files
from PIL import Image

from ascend_vlm.vision_input import QwenVLPixels


@pytest.fixture(scope="module")
def reference():
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448)


@pytest.mark.parametrize("workers", [1, 3])
def test_outputs_equal_hugging_faces_over_the_corpus(reference, workers):
    images = corpus()
    expected = reference(images=images, return_tensors="pt")
    got = QwenVLPixels(reference, workers=workers)(images, return_tensors="pt")
    assert torch.equal(got["image_grid_thw"], expected["image_grid_thw"])
    assert got["pixel_values"].dtype == expected["pixel_values"].dtype == torch.float32
    # Bit for bit: the table holds Hugging Face's own float arithmetic per 8-bit value.
    assert torch.equal(got["pixel_values"], expected["pixel_values"])
    for image in images:  # one at a time too
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
    images = [Image.fromarray(noise(100, 140, seed=9))]
    expected = processor(text=[prompt], images=images, return_tensors="pt")
    processor.image_processor = QwenVLPixels(processor.image_processor)
    got = processor(text=[prompt], images=images, return_tensors="pt")
    assert expected.keys() == got.keys()
    assert all(torch.equal(got[key], expected[key]) for key in expected)


def test_bad_input_is_named(reference):
    pixels = QwenVLPixels(reference, workers=1)
    with pytest.raises(ValueError, match=r"images\[1\]: expected a local image file, .* got bytes"):
        pixels([Image.new("RGB", (8, 8)), b"a.png"])
    with pytest.raises(ValueError, match=r"images\[0\]: expected an array of shape HxWxC or"):
        pixels([np.zeros((4, 4), dtype=np.float32)])
    with pytest.raises(ValueError, match=r"images\[1\]: expected a non-empty image, got 0x7"):
        pixels([Image.new("RGB", (8, 8)), Image.new("RGB", (0, 7))])
    with pytest.raises(ValueError, match=r"images\[0\]: expected a non-empty image, got shape"):
        pixels([np.zeros((0, 7, 3), dtype=np.uint8)])
    with pytest.raises(ValueError, match=r"images\[0\]: absolute aspect ratio must be smaller"):
        pixels([Image.new("RGB", (3000, 10))])
    buffer = io.BytesIO()
    Image.fromarray(noise(64, 64)).save(buffer, format="PNG")
    truncated = Image.open(io.BytesIO(buffer.getvalue()[:200]))
    with pytest.raises(ValueError, match=r"images\[0\]: cannot read the image"):
        pixels([truncated])
    with pytest.raises(ValueError, match="kwargs: expected none but return_tensors='pt'"):
        pixels([Image.new("RGB", (8, 8))], return_tensors="np")
    with pytest.raises(ValueError, match="workers: expected an int >= 1"):
        QwenVLPixels(reference, workers=0)


def test_tensors_float_arrays_and_data_urls_equal_the_reference(reference):
    import base64

    pixels = QwenVLPixels(reference, workers=1)
    image = noise(56, 84)
    unit = image.astype(np.float32) / 255.0
    for source in (unit, torch.from_numpy(unit).permute(2, 0, 1)):
        expected = reference(images=[source], return_tensors="pt")
        got = pixels([source])
        assert all(torch.equal(got[key], expected[key]) for key in expected)
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    expected = reference(images=[Image.fromarray(image)], return_tensors="pt")
    got = pixels([url])
    assert all(torch.equal(got[key], expected[key]) for key in expected)


def test_a_reference_with_a_step_turned_off_is_refused():
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    with pytest.raises(ValueError, match=r"got \['do_normalize'\] off"):
        QwenVLPixels(Qwen2VLImageProcessorPil(do_normalize=False))


def test_a_glm4v_reference_is_refused_and_with_fast_pixels_falls_back():
    # GLM-4V's module has a smart_resize of its own (frame count first, other rounding).
    from types import SimpleNamespace

    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    from ascend_vlm.vision_input.fast_processor import with_fast_pixels

    with pytest.raises(ValueError, match=r"smart_resize\('height', 'width'\); .*glm4v does not"):
        QwenVLPixels(Glm4vImageProcessorPil())
    processor = SimpleNamespace(image_processor=Glm4vImageProcessorPil())
    assert with_fast_pixels(processor) is processor


def test_qwen3_vl_settings_equal_hugging_faces():
    """Qwen3-VL uses the Qwen2-VL image processor with patch 16 and mean/std 0.5."""
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    reference = Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        min_pixels=64 * 64,
        max_pixels=512 * 512,
    )
    images = corpus()
    expected = reference(images=images, return_tensors="pt")
    got = QwenVLPixels(reference, workers=2)(images)
    assert got["pixel_values"].shape[1] == 3 * 2 * 16 * 16
    assert torch.equal(got["image_grid_thw"], expected["image_grid_thw"])
    assert torch.equal(got["pixel_values"], expected["pixel_values"])


def test_file_paths_load_as_hugging_faces_do_and_decode_in_the_workers(reference, tmp_path):
    paths = saved_files(tmp_path)
    expected = reference(images=paths, return_tensors="pt")
    got = QwenVLPixels(reference, workers=2)(paths)
    # EXIF orientation 6 and 8 turn the 60x90 image upright as 90x60: grids swap.
    assert expected["image_grid_thw"][-2].tolist() != expected["image_grid_thw"][-3].tolist()
    assert torch.equal(got["image_grid_thw"], expected["image_grid_thw"])
    assert torch.equal(got["pixel_values"], expected["pixel_values"])


def test_bad_paths_are_named(reference, tmp_path):
    pixels = QwenVLPixels(reference, workers=2)
    good = saved_files(tmp_path)[0]
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(Path(good).read_bytes()[:300])
    with pytest.raises(ValueError, match=r"images\[1\]: cannot read the image"):
        pixels([good, str(truncated)])  # fails in a worker thread, named in the caller
    with pytest.raises(ValueError, match=r"images\[0\]: .*got '/no/such.png' \(no such file\)"):
        pixels(["/no/such.png"])
    # port 9 (discard) on loopback: nothing listens, the fetch is refused at once
    with pytest.raises(ValueError, match=r"images\[0\]: cannot read an image from 'http://127"):
        pixels(["http://127.0.0.1:9/a.png"])
    (tmp_path / "text.png").write_text("not an image")
    with pytest.raises(ValueError, match=r"images\[0\]: cannot open"):
        pixels([tmp_path / "text.png"])


def test_arrays_of_every_channel_layout_and_nested_lists_as_hugging_face(reference):
    rng = np.random.default_rng(5)
    shapes = [(60, 40, 1), (1, 60, 40), (3, 60, 40), (60, 40, 4), (4, 60, 40), (3, 60, 3)]
    arrays = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in shapes]
    pixels = QwenVLPixels(reference, workers=2)
    for images in (arrays, [[arrays[0]], arrays[1:3]], np.stack([arrays[2], arrays[2]])):
        expected = reference(images=images, return_tensors="pt")
        got = pixels(images)
        assert torch.equal(got["image_grid_thw"], expected["image_grid_thw"])
        assert torch.equal(got["pixel_values"], expected["pixel_values"])
    with pytest.raises(ValueError, match="images: expected at least one image, got none"):
        pixels([])
    with pytest.raises(
        ValueError, match=r"images\[0\]: expected an array of shape .*got shape \(5, 5\)"
    ):
        pixels([np.zeros((5, 5), np.uint8)])  # refused by Hugging Face too


def test_a_torchvision_backend_reference_is_refused_and_with_fast_pixels_falls_back(reference):
    from types import SimpleNamespace

    from ascend_vlm.vision_input.fast_processor import with_fast_pixels

    class TorchvisionQwen(type(reference)):
        backend = "torchvision"

    with pytest.raises(ValueError, match=r"expected the PIL backend .* backend 'torchvision'"):
        QwenVLPixels(TorchvisionQwen())
    other = SimpleNamespace(image_processor=TorchvisionQwen())
    assert with_fast_pixels(other) is other
    processor = SimpleNamespace(image_processor=reference, tokenizer="t")
    fast = with_fast_pixels(processor)
    assert isinstance(fast.image_processor, QwenVLPixels) and fast.tokenizer == "t"
    assert processor.image_processor is reference  # the original is left as it was


def test_a_pixel_cache_copies_what_it_processed_before(reference):
    from ascend_vlm.vision_input.content_cache import ContentCache

    images = corpus()[:4]
    expected = reference(images=images, return_tensors="pt")
    pixels = QwenVLPixels(reference, workers=2)
    pixels.pixel_cache = ContentCache(1 << 30, size_of=lambda rows: rows.nbytes)
    first = pixels(images[:2], return_tensors="pt")
    # Equal images (a copy, not the same object) hit; the others are processed.
    again = pixels([images[1].copy(), *images[2:], images[0]], return_tensors="pt")
    assert (pixels.pixel_cache.hits, pixels.pixel_cache.misses) == (2, 4)
    rows = [int(t * h * w) for t, h, w in expected["image_grid_thw"].tolist()]
    per_image = torch.split(expected["pixel_values"], rows)
    assert torch.equal(first["pixel_values"], torch.cat(per_image[:2]))
    reordered = [per_image[1], *per_image[2:], per_image[0]]
    assert torch.equal(again["pixel_values"], torch.cat(reordered))


def test_the_pixel_cache_tells_palettes_apart(reference):
    from ascend_vlm.vision_input.content_cache import ContentCache

    indices = Image.fromarray(noise(60, 80, seed=3)[..., 0] % 4)
    red, blue = indices.copy(), indices.copy()
    red.putpalette([255, 0, 0, 0, 0, 0, 9, 9, 9, 90, 90, 90])
    blue.putpalette([0, 0, 255, 0, 0, 0, 9, 9, 9, 90, 90, 90])
    pixels = QwenVLPixels(reference, workers=1)
    pixels.pixel_cache = ContentCache(1 << 30, size_of=lambda rows: rows.nbytes)
    for image in (red, blue):
        got = pixels([image], return_tensors="pt")["pixel_values"]
        assert torch.equal(got, reference(images=[image], return_tensors="pt")["pixel_values"])
    assert pixels.pixel_cache.hits == 0


def test_a_shared_pixel_cache_keys_each_processors_settings(reference):
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    from ascend_vlm.data.content_keys import vouch_content_key
    from ascend_vlm.vision_input.content_cache import ContentCache

    shared = ContentCache(1 << 30, size_of=lambda rows: rows.nbytes)
    other = Qwen2VLImageProcessorPil(
        min_pixels=56 * 56, max_pixels=448 * 448, image_mean=[0.5, 0.5, 0.5]
    )
    image = corpus()[0]
    vouched = image.copy()  # the same content, keyed by its vouched key instead of its pixels
    vouch_content_key(vouched, b"k" * 16)
    for settings in (reference, other, reference):
        pixels = QwenVLPixels(settings, workers=1)
        pixels.pixel_cache = shared
        expected = settings(images=[image], return_tensors="pt")["pixel_values"]
        for candidate in (image, vouched):
            assert torch.equal(pixels([candidate], return_tensors="pt")["pixel_values"], expected)
    assert (shared.hits, shared.misses) == (2, 4)
