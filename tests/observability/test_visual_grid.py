"""visual_token_cells / cell_pixel_map against the real image processors.

The strongest checks paint one token's box white on a black original image, run the processor
and find which patches of its pixel_values are bright: they must be exactly that token's
patches. Expected boxes are computed here from grid/size arithmetic, not by the module.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from ascend_vlm.observability.visual_grid import ImageCells, cell_pixel_map, visual_token_cells

BRIGHT = 0.5


def _white_box_image(size: tuple[int, int], box) -> Image.Image:
    """A black image with white pixels on the box rounded inward."""
    image = Image.new("RGB", size, "black")
    x0, y0, x1, y1 = math.ceil(box[0]), math.ceil(box[1]), math.floor(box[2]), math.floor(box[3])
    assert x1 > x0 and y1 > y0, f"box {box} has no whole pixel"
    ImageDraw.Draw(image).rectangle((x0, y0, x1 - 1, y1 - 1), fill="white")
    return image


def _expected_mask(size: tuple[int, int], box) -> np.ndarray:
    """[H, W] True where the pixel centre lies in box (x1/y1 exclusive)."""
    width, height = size
    xs, ys = np.arange(width) + 0.5, np.arange(height) + 0.5
    in_x = (xs >= box[0]) & (xs < box[2])
    in_y = (ys >= box[1]) & (ys < box[3])
    return in_y[:, None] & in_x[None, :]


def _one_hot(cells: ImageCells, k: int) -> np.ndarray:
    weights = np.zeros(cells.rows * cells.cols)
    weights[k] = 1.0
    return weights


# ---------------------------------------------------------------- Qwen-VL


@pytest.fixture(scope="module")
def qwen(model_and_processor):
    model, processor = model_and_processor
    return model.config, processor


def _qwen_token_brightness(rows: torch.Tensor, image_processor) -> np.ndarray:
    """[tokens, merge^2] mean brightness in [0, 1] of each patch of one image's pixel_values.

    pixel_values rows are patches in merge-block order (all merge x merge patches of merged
    token 0, then token 1, ...); a row is (channel, temporal, patch, patch), normalised."""
    merge = image_processor.merge_size
    channels = len(image_processor.image_mean)
    values = rows.double().numpy().reshape(len(rows), channels, -1)
    mean = np.asarray(image_processor.image_mean)[None, :, None]
    std = np.asarray(image_processor.image_std)[None, :, None]
    brightness = (values * std + mean).mean(axis=(1, 2))
    return brightness.reshape(-1, merge * merge)


def _qwen_expected_box(size, grid_h, grid_w, merge, k):
    width, height = size
    rows, cols = grid_h // merge, grid_w // merge
    r, c = divmod(k, cols)
    return (c * width / cols, r * height / rows, (c + 1) * width / cols, (r + 1) * height / rows)


def _check_qwen_token(config, image_processor, run, size, image_index, k):
    """Token k of image `image_index`: its map is its first-principles box, and painting that
    box white lights exactly its patches in pixel_values. `run(image)` returns the processor
    output for a prompt where `image` is at position image_index, with the prompt's images
    added under "images"."""
    blank = run(Image.new("RGB", size, "black"))
    cells = visual_token_cells(config, image_processor, blank["images"], blank)[image_index]
    grid = blank["image_grid_thw"][image_index].tolist()
    merge = image_processor.merge_size
    box = _qwen_expected_box(size, grid[1], grid[2], merge, k)
    np.testing.assert_allclose(cells.boxes[k], box)

    pixel_map = cell_pixel_map(cells, _one_hot(cells, k))
    assert not np.isnan(pixel_map).any()  # the whole image is resized, nothing is lost
    np.testing.assert_array_equal(pixel_map != 0, _expected_mask(size, box))

    painted = run(_white_box_image(size, box))
    start = int(painted["image_grid_thw"][:image_index].prod(dim=-1).sum())
    count = int(painted["image_grid_thw"][image_index].prod())
    brightness = _qwen_token_brightness(
        painted["pixel_values"][start : start + count], image_processor
    )
    others = np.delete(brightness, k, axis=0)
    assert brightness[k].min() > BRIGHT, (k, brightness[k])
    assert others.max() < BRIGHT, (k, others.max())


def _qwen_runner(processor, images_before: int, images_after: int):
    """run(image) -> processor output for a chat prompt whose images are
    [black 56x56] * images_before + [image] + [black 84x56] * images_after."""
    count = images_before + 1 + images_after
    content = [{"type": "image"}] * count + [{"type": "text", "text": "q"}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )

    def run(image):
        images = (
            [Image.new("RGB", (56, 56))] * images_before
            + [image]
            + [Image.new("RGB", (84, 56))] * images_after
        )
        output = processor(text=prompt, images=images, return_tensors="pt")
        output["images"] = images
        return output

    return run


@pytest.mark.parametrize("size", [(112, 112), (101, 67), (67, 101), (20, 30)])
def test_qwen_token_boxes_hold_the_pixels_the_processor_gives_the_token(qwen, size):
    config, processor = qwen
    run = _qwen_runner(processor, 0, 0)
    blank = run(Image.new("RGB", size))
    cells = visual_token_cells(config, processor.image_processor, blank["images"], blank)[0]
    for k in range(cells.rows * cells.cols):
        _check_qwen_token(config, processor.image_processor, run, size, 0, k)


def test_qwen_second_image_of_a_multi_image_prompt(qwen):
    config, processor = qwen
    run = _qwen_runner(processor, 1, 1)
    size = (101, 67)
    for k in range(8):  # 101 x 67 -> 112 x 56 pixels -> 2 x 4 tokens
        _check_qwen_token(config, processor.image_processor, run, size, 1, k)


def test_qwen_cells_count_the_image_tokens_of_input_ids(qwen):
    config, processor = qwen
    sizes = [(112, 112), (101, 67), (20, 30)]
    content = [{"type": "image"}] * 3 + [{"type": "text", "text": "q"}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    images = [Image.new("RGB", size) for size in sizes]
    inputs = processor(text=prompt, images=images, return_tensors="pt")
    cells = visual_token_cells(config, processor.image_processor, images, inputs)

    assert [c.image_index for c in cells] == [0, 1, 2]
    assert [c.image_size for c in cells] == sizes
    is_image = (inputs["input_ids"][0] == config.image_token_id).tolist()
    runs = [len(list(group)) for key, group in itertools.groupby(is_image) if key]
    assert runs == [c.rows * c.cols for c in cells]
    assert [(c.rows, c.cols) for c in cells] == [(4, 4), (2, 4), (3, 2)]


def _check_a_90x50_image_is_2x3_tokens(model_type: str, image_processor) -> None:
    """Every token of a 90 x 50 image, which ``image_processor`` (2 x 2 merge) resizes onto 6 x
    4 patches, holds the pixels the processor gives it."""
    config = SimpleNamespace(
        model_type=model_type, vision_config=SimpleNamespace(spatial_merge_size=2)
    )

    def run(image):
        output = image_processor(images=[image], return_tensors="pt")
        output["images"] = [image]
        return output

    size = (90, 50)
    blank = run(Image.new("RGB", size))
    cells = visual_token_cells(config, image_processor, blank["images"], blank)[0]
    assert (cells.rows, cells.cols) == (2, 3)
    for k in range(6):
        _check_qwen_token(config, image_processor, run, size, 0, k)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl"])
def test_qwen_families_share_the_geometry_with_16_pixel_patches(model_type):
    """Qwen2.5-VL and Qwen3-VL use Qwen2-VL's image processor; Qwen3-VL checkpoints configure
    it with 16-pixel patches (90 x 50 -> 96 x 64 pixels)."""
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, min_pixels=32 * 32, max_pixels=128 * 128
    )
    _check_a_90x50_image_is_2x3_tokens(model_type, image_processor)


def test_glm4v_image_processor_shares_the_geometry():
    """GLM-4V's image processor sizes images by its own rule (90 x 50 -> 84 x 56 pixels) but,
    like Qwen-VL's, resizes the whole image onto the patch grid and merges 2 x 2 patches per
    token."""
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil

    image_processor = Glm4vImageProcessorPil(
        size={"shortest_edge": 28 * 28, "longest_edge": 2 * 112 * 112}
    )
    _check_a_90x50_image_is_2x3_tokens("glm4v", image_processor)


def test_qwen_refuses_mismatched_inputs(qwen):
    config, processor = qwen
    image = Image.new("RGB", (56, 56))
    inputs = processor.image_processor(images=[image], return_tensors="pt")
    with pytest.raises(ValueError, match=r"image_grid_thw.*expected shape \(2, 3\)"):
        visual_token_cells(config, processor.image_processor, [image, image], inputs)
    with pytest.raises(ValueError, match="holding image_grid_thw"):
        visual_token_cells(config, processor.image_processor, [image], {"pixel_values": 0})
    other = SimpleNamespace(
        model_type="qwen2_vl", vision_config=SimpleNamespace(spatial_merge_size=4)
    )
    with pytest.raises(ValueError, match="merge_size"):
        visual_token_cells(other, processor.image_processor, [image], inputs)
    with pytest.raises(ValueError, match=r"images\[0\]: expected a PIL.Image.Image"):
        visual_token_cells(config, processor.image_processor, [np.zeros((56, 56, 3))], inputs)


# ---------------------------------------------------------------- LLaVA


def _llava_config(tower: str = "clip_vision_model", strategy: str = "default"):
    from transformers import LlavaConfig

    return LlavaConfig(
        vision_config={"model_type": tower, "patch_size": 8, "image_size": 32},
        text_config={"model_type": "llama", "vocab_size": 600},
        vision_feature_select_strategy=strategy,
        image_token_id=5,
    )


def _clip_processor(**kwargs):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    return CLIPImageProcessorPil(
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        do_normalize=False,
        **kwargs,
    )


def _llava_bright_patches(image_processor, image: Image.Image, patch: int = 8) -> np.ndarray:
    """[rows, cols] mean brightness in [0, 1] of each patch (processors without normalisation)."""
    pixels = image_processor(images=[image], return_tensors="pt")["pixel_values"][0].numpy()
    _, height, width = pixels.shape
    blocks = pixels.reshape(3, height // patch, patch, width // patch, patch)
    return blocks.mean(axis=(0, 2, 4))


def _check_llava_token(config, image_processor, size, k):
    image = Image.new("RGB", size)
    inputs = image_processor(images=[image], return_tensors="pt")
    cells = visual_token_cells(config, image_processor, [image], inputs)[0]
    brightness = _llava_bright_patches(image_processor, _white_box_image(size, cells.boxes[k]))
    r, c = divmod(k, cells.cols)
    others = np.delete(brightness.reshape(-1), k)
    assert brightness[r, c] > BRIGHT, (k, brightness)
    assert others.max() < BRIGHT, (k, brightness)
    return cells


@pytest.mark.parametrize("size", [(64, 40), (40, 64), (32, 32)])
def test_llava_clip_center_crop_boxes_hold_each_patch(size):
    config, image_processor = _llava_config(), _clip_processor()
    for k in range(16):
        cells = _check_llava_token(config, image_processor, size, k)
    assert (cells.rows, cells.cols) == (4, 4)


@pytest.mark.parametrize(
    ("size", "resized", "start"),
    [
        # The short side becomes 32, the long side int(32 * long / short): 51.2 -> 51 and
        # 53.6 -> 53 (truncated, not rounded); the 32-pixel crop starts at (long' - 32) // 2.
        ((64, 40), (51, 32), (9, 0)),
        ((67, 40), (53, 32), (10, 0)),
        ((40, 67), (32, 53), (0, 10)),
    ],
)
def test_llava_clip_crop_boxes_from_first_principles_and_cropped_pixels_are_nan(
    size, resized, start
):
    config, image_processor = _llava_config(), _clip_processor()
    image = Image.new("RGB", size)
    cells = visual_token_cells(config, image_processor, [image], image_processor(images=[image]))[0]
    # A resized pixel spans W / W' x H / H' original pixels.
    sx, sy = size[0] / resized[0], size[1] / resized[1]
    for k in range(16):
        r, c = divmod(k, 4)
        x0, y0 = start[0] + 8 * c, start[1] + 8 * r
        expected = (x0 * sx, y0 * sy, (x0 + 8) * sx, (y0 + 8) * sy)
        np.testing.assert_allclose(cells.boxes[k], expected)

    pixel_map = cell_pixel_map(cells, np.arange(16.0))
    kept_box = (start[0] * sx, start[1] * sy, (start[0] + 32) * sx, (start[1] + 32) * sy)
    kept = _expected_mask(size, kept_box)
    assert not kept.all()
    np.testing.assert_array_equal(~np.isnan(pixel_map), kept)
    # The processor agrees: white where the map is NaN vanishes, white where it is not fills.
    white_outside = Image.fromarray(
        np.where(kept, 0, 255).astype(np.uint8)[:, :, None].repeat(3, 2)
    )
    white_inside = Image.fromarray(np.where(kept, 255, 0).astype(np.uint8)[:, :, None].repeat(3, 2))
    assert _llava_bright_patches(image_processor, white_outside).max() < 0.2
    assert _llava_bright_patches(image_processor, white_inside).min() > 0.8


def test_llava_siglip_resize_to_fixed_size():
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    config = _llava_config("siglip_vision_model", "full")
    image_processor = SiglipImageProcessorPil(size={"height": 32, "width": 24}, do_normalize=False)
    size = (50, 70)
    for k in range(12):
        cells = _check_llava_token(config, image_processor, size, k)
    assert (cells.rows, cells.cols) == (4, 3)
    np.testing.assert_allclose(cells.boxes[4], (50 / 3, 70 / 4, 100 / 3, 70 / 2))
    assert not np.isnan(cell_pixel_map(cells, np.ones(12))).any()


def test_llava_pad_to_square_leaves_padding_tokens_without_pixels():
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    config = _llava_config()
    image_processor = LlavaImageProcessorPil(
        do_pad=True,
        size={"shortest_edge": 32},
        crop_size={"height": 32, "width": 32},
        do_normalize=False,
        image_mean=(0.0, 0.0, 0.0),  # black padding, so only the painted box is bright
    )
    size = (64, 24)  # padded to 64 x 64 with the image at rows 20..44, then halved
    image = Image.new("RGB", size)
    cells = visual_token_cells(config, image_processor, [image], image_processor(images=[image]))[0]
    # Token row r sees padded rows [16 r, 16 r + 16), i.e. image rows [16 r - 20, 16 r - 4).
    for r, (top, bottom) in enumerate([(0, 0), (0, 12), (12, 24), (24, 24)]):
        np.testing.assert_allclose(cells.boxes[4 * r : 4 * r + 4, [1, 3]], [[top, bottom]] * 4)
    pixel_map = cell_pixel_map(cells, np.arange(16.0))
    assert not np.isin([0, 1, 2, 3, 12, 13, 14, 15], pixel_map).any()
    for k in range(4, 12):
        _check_llava_token(config, image_processor, size, k)


def test_llava_bottom_right_batch_padding_moves_nothing():
    """Without a crop, CLIP's processor pads each image bottom/right to the batch's largest."""
    config = _llava_config()
    image_processor = _clip_processor(do_center_crop=False, do_pad=True)
    images = [Image.new("RGB", (64, 40)), Image.new("RGB", (32, 48))]
    inputs = image_processor(images=images, return_tensors="pt")
    assert tuple(inputs["pixel_values"].shape[-2:]) == (48, 51)  # 51 x 32 and 32 x 48 padded
    wide, tall = visual_token_cells(config, image_processor, images, inputs)
    assert (wide.rows, wide.cols) == (tall.rows, tall.cols) == (6, 6)
    # 64 x 40 -> 51 x 32: rows 4 and 5 are padding; 32 x 48 is not resized: columns 4, 5 are.
    np.testing.assert_allclose(wide.boxes[7], (64 / 51 * 8, 10, 64 / 51 * 16, 20))
    assert (wide.boxes[24:, 1] == wide.boxes[24:, 3]).all()
    np.testing.assert_allclose(tall.boxes[7], (8, 8, 16, 16))
    assert (tall.boxes[4::6, 0] == tall.boxes[4::6, 2]).all()
    assert (tall.boxes[5::6, 0] == tall.boxes[5::6, 2]).all()


def test_llava_cells_count_the_image_tokens_of_input_ids(model_and_processor):
    from transformers import LlavaProcessor

    tokenizer = model_and_processor[1].tokenizer
    image_processor = _clip_processor()
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<|image_pad|>",
    )
    images = [Image.new("RGB", (64, 40)), Image.new("RGB", (30, 50))]
    inputs = processor(text="<|image_pad|> a <|image_pad|>", images=images, return_tensors="pt")
    cells = visual_token_cells(_llava_config(), image_processor, images, inputs)
    count = int((inputs["input_ids"] == processor.image_token_id).sum())
    assert count == sum(c.rows * c.cols for c in cells) == 32
    assert [c.image_size for c in cells] == [(64, 40), (30, 50)]


def test_llava_refuses_tokens_that_are_not_patches():
    image = Image.new("RGB", (40, 40))
    image_processor = _clip_processor()
    inputs = image_processor(images=[image])
    with pytest.raises(ValueError, match=r"'full'.*CLS token has no place"):
        visual_token_cells(_llava_config(strategy="full"), image_processor, [image], inputs)
    with pytest.raises(ValueError, match="drops the first image patch"):
        visual_token_cells(_llava_config("siglip_vision_model"), image_processor, [image], inputs)
    with pytest.raises(ValueError, match=r"one image per entry of images \(2\), got 1"):
        visual_token_cells(_llava_config(), image_processor, [image, image], inputs)
    with pytest.raises(ValueError, match=r"expected a 32 x 32 image .* got 24 x 24"):
        visual_token_cells(
            _llava_config(), image_processor, [image], {"pixel_values": torch.zeros(1, 3, 24, 24)}
        )


# ---------------------------------------------------------------- shared errors


def test_unsupported_model_type_names_the_supported_ones():
    config = SimpleNamespace(model_type="idefics3")
    # the families registered between and after these may support the overlay too
    with pytest.raises(
        ValueError, match=r"qwen2_vl, qwen2_5_vl, qwen3_vl(, \w+)*, got 'idefics3'"
    ) as caught:
        visual_token_cells(config, None, [], {})
    assert ", llava, " in str(caught.value)


def test_cell_pixel_map_refuses_wrong_weights():
    boxes = np.array([[0, 0, 5, 4], [5, 0, 10, 4]], dtype=np.float64)
    cells = ImageCells(0, 1, 2, boxes, (10, 4))
    with pytest.raises(
        ValueError, match=r"weights: expected a 1-D array of 2 values .* got shape \(3,\)"
    ):
        cell_pixel_map(cells, np.zeros(3))
    with pytest.raises(ValueError, match=r"got shape \(1, 2\)"):
        cell_pixel_map(cells, torch.zeros(1, 2))
    with pytest.raises(ValueError, match="finite"):
        cell_pixel_map(cells, [0.0, float("nan")])
    pixel_map = cell_pixel_map(cells, torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    np.testing.assert_array_equal(pixel_map[:, :5], 1.0)
    np.testing.assert_array_equal(pixel_map[:, 5:], 2.0)
