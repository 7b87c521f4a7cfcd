"""`load_image`: every kind of image source a command or API takes, and every bad one refused
with a ValueError naming the image."""

from __future__ import annotations

import base64
import io
import re

import numpy as np
import pytest
import torch
from PIL import Image

from ascend_vlm.data.images import ACCEPTED_IMAGES, load_image, load_image_bytes

ACCEPTED = re.escape(ACCEPTED_IMAGES)


def _picture() -> Image.Image:
    pixels = np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3) * 2
    return Image.fromarray(pixels)


def _png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def served(loopback_http):
    """The base URL of a loopback HTTP server over a folder holding picture.png."""
    folder, url = loopback_http
    (folder / "picture.png").write_bytes(_png_bytes(_picture()))
    return url


def _same(image: Image.Image, expected: Image.Image) -> None:
    assert image.mode == "RGB"
    assert np.array_equal(np.asarray(image), np.asarray(expected.convert("RGB")))


def test_paths_pil_images_and_uint8_arrays_load_as_rgb(tmp_path):
    expected = _picture()
    path = tmp_path / "picture.png"
    path.write_bytes(_png_bytes(expected))
    _same(load_image(path), expected)
    _same(load_image(str(path)), expected)
    _same(load_image(expected.convert("L")), expected.convert("L"))
    hwc = np.asarray(expected)
    _same(load_image(hwc), expected)
    _same(load_image(np.ascontiguousarray(hwc.transpose(2, 0, 1))), expected)


def test_float_arrays_and_tensors_in_unit_range_are_rescaled():
    expected = _picture()
    unit = np.asarray(expected).astype(np.float32) / 255.0
    _same(load_image(unit), expected)
    _same(load_image(torch.from_numpy(unit).permute(2, 0, 1)), expected)


def test_http_and_data_urls_load(served):
    expected = _picture()
    _same(load_image(f"{served}/picture.png"), expected)
    encoded = base64.b64encode(_png_bytes(expected)).decode()
    _same(load_image(f"data:image/png;base64,{encoded}"), expected)


def test_a_url_that_fails_is_named_unmangled(served):
    url = f"{served}/missing.png"
    with pytest.raises(ValueError, match=rf"^--image: cannot read an image from '{url}'"):
        load_image(url, name="--image")


def test_a_truncated_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "truncated.png"
    path.write_bytes(_png_bytes(Image.new("RGB", (64, 64), "red"))[:-40])
    with pytest.raises(ValueError, match=r"^images\[1\]: cannot read the image's pixels"):
        load_image(path, name="images[1]")


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("/no/such.png", rf"^image: expected {ACCEPTED}, got '/no/such.png' \(no such file\)$"),
        (Image.new("RGB", (0, 0)), r"^image: expected a non-empty image, got 0x0 pixels$"),
        (Image.new("RGB", (0, 7)), r"^image: expected a non-empty image, got 0x7 pixels$"),
        (np.zeros((0, 7, 3), np.uint8), r"^image: expected a non-empty image, got shape"),
        (np.zeros((4, 4), np.uint8), r"^image: expected an HxWxC or CxHxW array"),
        (np.zeros((4, 4, 3), np.int32), r"^image: expected a uint8 or float array, got dtype"),
        (np.full((4, 4, 3), 2.0), r"^image: expected float pixel values in \[0, 1\]"),
    ],
    ids=["missing", "0x0", "0x7", "empty array", "2-D", "int32", "out of range"],
)
def test_bad_images_are_refused_naming_the_image(source, message):
    with pytest.raises(ValueError, match=message):
        load_image(source)


def test_other_kinds_are_a_type_error():
    with pytest.raises(TypeError, match=r"^image: expected a local image file, .* got int$"):
        load_image(3)


def test_bytes_load_as_their_file_does(tmp_path):
    # An EXIF orientation of 6 (rotate 90 degrees): the file and its bytes both load upright.
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    _picture().save(buffer, format="PNG", exif=exif)
    path = tmp_path / "turned.png"
    path.write_bytes(buffer.getvalue())
    from_file = load_image(path)
    assert from_file.size == (5, 7)
    _same(load_image_bytes(buffer.getvalue(), name="images[0]"), from_file)
    with pytest.raises(ValueError, match=r"^images\[0\]: cannot read the data as an image"):
        load_image_bytes(b"not an image", name="images[0]")
    with pytest.raises(ValueError, match=r"^images\[0\]: cannot read the image's pixels"):
        load_image_bytes(_png_bytes(Image.new("RGB", (64, 64), "red"))[:-40], name="images[0]")
