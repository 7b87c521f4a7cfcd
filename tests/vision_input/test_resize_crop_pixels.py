"""ResizeCropPixels: equal to Hugging Face's CLIP, SigLIP and LLaVA PIL image processors over
the corpus, through a processor and into a staging slot; other pipelines refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from image_corpus import corpus, noise, saved_files
from PIL import Image

from ascend_vlm.vision_input import ResizeCropPixels
from ascend_vlm.vision_input.staging import StagingPool


def _references():
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    return {
        "clip": CLIPImageProcessorPil(),
        "clip-336": CLIPImageProcessorPil(
            size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}
        ),
        "siglip-384": SiglipImageProcessorPil(size={"height": 384, "width": 384}),
        "llava-pad": LlavaImageProcessorPil(do_pad=True),
        # An odd number of values per channel: looked up one at a time, not in pairs.
        "clip-odd": CLIPImageProcessorPil(crop_size={"height": 225, "width": 225}),
        # A crop larger than the resized image: the reference pads it with zeros.
        "clip-crop-past-edge": CLIPImageProcessorPil(
            size={"shortest_edge": 200}, crop_size={"height": 224, "width": 224}
        ),
    }


@pytest.mark.parametrize(
    "name", ["clip", "clip-336", "siglip-384", "llava-pad", "clip-odd", "clip-crop-past-edge"]
)
def test_outputs_equal_hugging_faces_over_the_corpus(name):
    reference = _references()[name]
    images = corpus()
    expected = reference(images=images, return_tensors="pt")["pixel_values"]
    pixels = ResizeCropPixels(reference, workers=2)
    got = pixels(images, return_tensors="pt")["pixel_values"]
    assert got.dtype == expected.dtype == torch.float32
    assert got.shape == expected.shape == (len(images), 3, pixels.height, pixels.width)
    assert torch.equal(got, expected)
    pixels.close()


def test_a_drop_in_for_a_llava_processors_image_part():
    from transformers import AutoTokenizer, LlavaProcessor

    from ascend_vlm.default_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    processor = LlavaProcessor(
        image_processor=_references()["llava-pad"],
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        image_token="<|image_pad|>",
    )
    images = [Image.fromarray(noise(90, 150, seed=3))]
    text = ["<|image_pad|> What colour is it?"]
    expected = processor(text=text, images=images, return_tensors="pt")
    processor.image_processor = ResizeCropPixels(processor.image_processor, workers=1)
    got = processor(text=text, images=images, return_tensors="pt")
    assert expected.keys() == got.keys()
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # (224 / 14)^2 patches, less one under the "default" feature strategy
    assert int((expected["input_ids"] == image_token).sum()) == 255
    assert all(torch.equal(got[key], expected[key]) for key in expected)


def test_staged_output_shares_a_slot():
    reference = _references()["clip"]
    images = [Image.fromarray(noise(90, 150, seed=3)), Image.fromarray(noise(300, 200, seed=4))]
    with StagingPool(slots=1) as pool:
        staged = ResizeCropPixels(reference, workers=1)(images, staging=pool)["pixel_values"]
        assert torch.equal(staged, reference(images=images, return_tensors="pt")["pixel_values"])
        assert pool.in_use == 1
        del staged
        assert pool.in_use == 0


def test_other_pipelines_and_varying_sizes_are_refused():
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    with pytest.raises(ValueError, match="Idefics3ImageProcessorPil has its own preprocessing"):
        ResizeCropPixels(Idefics3ImageProcessorPil())
    with pytest.raises(ValueError, match="Qwen2VLImageProcessorPil has its own preprocessing"):
        ResizeCropPixels(Qwen2VLImageProcessorPil())
    with pytest.raises(ValueError, match="expected do_pad off"):
        ResizeCropPixels(CLIPImageProcessorPil(do_pad=True, pad_size={"height": 240, "width": 240}))
    with pytest.raises(ValueError, match="expected a resize to a shortest edge alone"):
        ResizeCropPixels(CLIPImageProcessorPil(size={"shortest_edge": 224, "longest_edge": 400}))
    with pytest.raises(ValueError, match="expected one output size for every image"):
        ResizeCropPixels(CLIPImageProcessorPil(do_center_crop=False))
    with pytest.raises(ValueError, match=r"got \['do_resize'\] off"):
        ResizeCropPixels(CLIPImageProcessorPil(do_resize=False))
    with pytest.raises(ValueError, match=r"images\[0\]: expected an array of shape HxWxC"):
        ResizeCropPixels(CLIPImageProcessorPil(), workers=1)([np.zeros((2, 2), np.int32)])
    with pytest.raises(ValueError, match=r"images\[0\]: expected a non-empty image, got 0x0"):
        ResizeCropPixels(CLIPImageProcessorPil(), workers=1)([Image.new("RGB", (0, 0))])


def test_file_paths_load_as_hugging_faces_do(tmp_path):
    reference = _references()["llava-pad"]
    paths = saved_files(tmp_path)
    expected = reference(images=paths, return_tensors="pt")["pixel_values"]
    assert torch.equal(ResizeCropPixels(reference, workers=2)(paths)["pixel_values"], expected)


@pytest.mark.parametrize("name", ["clip", "siglip-384"])
def test_empty_images_are_refused_and_tensors_and_float_arrays_equal_the_reference(name):
    reference = _references()[name]
    pixels = ResizeCropPixels(reference, workers=1)
    for empty, size in ((Image.new("RGB", (0, 7)), "0x7"), (Image.new("RGB", (7, 0)), "7x0")):
        with pytest.raises(
            ValueError, match=rf"images\[0\]: expected a non-empty image, got {size}"
        ):
            pixels([empty])  # SigLIP's plain resize would turn it into a black image
    image = np.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    unit = image.astype(np.float32) / 255.0
    for source in (unit, torch.from_numpy(unit).permute(2, 0, 1), torch.from_numpy(image)):
        expected = reference(images=[source], return_tensors="pt")["pixel_values"]
        assert torch.equal(pixels([source])["pixel_values"], expected)
