"""Content keys vouched for images: a key holds for the very image it was vouched for (not for
copies, which PIL hands the image's info to, nor for equal images), and the keys of what a processor
makes of an image part when the images or the processor's settings differ."""

from __future__ import annotations

from PIL import Image

from ascend_vlm.data.content_keys import (
    derived_content_key,
    encoding_content_keys,
    processed_content_key,
    processed_content_keys,
    processor_settings_key,
    take_encoding_content_keys,
    vouch_content_key,
    vouched_content_key,
)

KEY = b"k" * 16


def test_a_key_holds_for_its_image_alone_while_it_lives():
    image = Image.new("RGB", (8, 6), "red")
    assert vouched_content_key(image) is None
    vouch_content_key(image, KEY)
    assert vouched_content_key(image) == KEY
    assert vouched_content_key(image.copy()) is None
    assert vouched_content_key(image.convert("L")) is None
    assert vouched_content_key(Image.new("RGB", (8, 6), "red")) is None  # equal pixels


def test_processed_keys_part_images_settings_and_derivations():
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    small = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    large = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=448 * 448)
    same = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    assert processor_settings_key(small) == processor_settings_key(same)
    assert processor_settings_key(small) != processor_settings_key(large)
    assert processor_settings_key(object()) is None
    first, second = Image.new("RGB", (8, 6)), Image.new("RGB", (8, 6))
    vouch_content_key(first, KEY)
    vouch_content_key(second, KEY)
    keys = processed_content_keys([first, second], small)
    assert keys == processed_content_keys([second, first], same)
    assert keys[0] != processed_content_key(first, processor_settings_key(large))
    assert processed_content_keys([first, Image.new("RGB", (8, 6))], small) is None
    assert derived_content_key(KEY, "thumbnail 512") not in (KEY, keys[0])


class _SettingsNotToBeRead:
    def to_dict(self):
        raise AssertionError("the settings were read for images without keys")


def test_images_without_keys_skip_reading_the_settings():
    unkeyed = Image.new("RGB", (8, 6))
    assert processed_content_keys([], _SettingsNotToBeRead()) is None
    assert processed_content_keys([unkeyed], _SettingsNotToBeRead()) is None


def test_the_first_encoding_in_a_block_takes_the_keys():
    assert take_encoding_content_keys(1) is None
    with encoding_content_keys((KEY, KEY)):
        assert take_encoding_content_keys(2) == (KEY, KEY)
        assert take_encoding_content_keys(2) is None
    with encoding_content_keys((KEY,)):
        assert take_encoding_content_keys(2) is None  # another count: other pixels
        assert take_encoding_content_keys(1) is None
    with encoding_content_keys(None):
        assert take_encoding_content_keys(0) is None
