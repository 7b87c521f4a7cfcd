"""The embedded default model: a tiny Qwen2-VL-architecture VLM built from seeded code.

Nothing is downloaded. :func:`build_default_model` creates, deterministically from a seed,

* a Qwen2-VL config with a 2-layer ViT (embed 64, 4 heads) and a 2-layer language model
  (hidden 128, 4 query / 2 key-value heads, M-RoPE sections [4, 6, 6]) with random weights;
* a byte-level BPE tokenizer trained on an embedded corpus, carrying Qwen2-VL's chat special
  tokens (``<|im_start|>``, ``<|vision_start|>``, ``<|image_pad|>`` ...) and a chat template;
* Qwen2-VL's image processor (PIL backend) limited to 56x56..112x112 pixels, i.e. at most
  16 image tokens per image;

and writes them with ``save_pretrained``. :func:`load_default_model` loads them back with
``from_pretrained``.

The saved processor is transformers' ``PaddleOCRVLProcessor`` (named in
``processor_config.json``): tokenizer + image processor with exactly Qwen2-VL's image-token
expansion and no video processor, so ``AutoProcessor.from_pretrained`` loads the folder without
torchvision. (``Qwen2VLProcessor`` needs torchvision for its video processor, which the CPU
set-up does not have.) transformers logs a deprecation notice about that class's
``image_processor_class`` on load; :func:`load_processor` filters it out, a plain
``AutoProcessor.from_pretrained`` still prints it. For other Qwen-VL-style checkpoints in that situation,
:class:`ImageTextProcessor` pairs their tokenizer and image processor the same way.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

# v2: the folder holds a processor_config.json that AutoProcessor loads without torchvision.
DEFAULT_MODEL_NAME = "tiny-qwen2-vl-v2"
IMAGE_TOKEN = "<|image_pad|>"
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    IMAGE_TOKEN,
    "<|video_pad|>",
)
# Qwen2-VL's conversation format; images become <|vision_start|><|image_pad|><|vision_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = (
    "what which how many is are there the a an of in on at to and or image picture shape shapes "
    "colour color count position left right top bottom upper lower middle centre center corner "
    "red green blue yellow purple orange black white gray grey pink cyan brown "
    "circle square triangle rectangle star diamond ellipse cross "
    "zero one two three four five six seven eight nine ten yes no "
    "question answer user assistant system you are helpful describe this"
)
TOKENIZER_VOCAB_SIZE = 512


def _train_tokenizer():
    """Byte-level BPE trained on the embedded corpus; deterministic for a fixed corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = _WORDS.split()
    corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    corpus += [f"{w.capitalize()}? {w}." for w in words] + [str(n) for n in range(100)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        chat_template=CHAT_TEMPLATE,
        extra_special_tokens={"image_token": IMAGE_TOKEN},
    )
    return fast


def _image_processor():
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)


def _processor(tokenizer, image_processor):
    """A processor without a video processor whose image-token expansion is Qwen2-VL's: each
    ``tokenizer.image_token`` becomes ``t*h*w / merge_size**2`` copies (``image_grid_thw``)."""
    from transformers import PaddleOCRVLProcessor

    return PaddleOCRVLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE
    )


def _config(tokenizer):
    from transformers import Qwen2VLConfig

    ids = tokenizer.convert_tokens_to_ids
    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [4, 6, 6],
        },
        "bos_token_id": ids("<|endoftext|>"),
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
    }
    vision_config = {
        "depth": 2,
        "embed_dim": 64,
        "hidden_size": 128,
        "num_heads": 4,
        "mlp_ratio": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return Qwen2VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids(IMAGE_TOKEN),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
    )


# The config fields naming the default tokenizer's special tokens.
TOKEN_ID_FIELDS = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def token_ids(config) -> dict[str, int]:
    """The special-token ids ``config`` holds (the default model's, or one built on its
    tokenizer), as keyword arguments for another Qwen-VL config on the same tokenizer. A field
    a transformers version does not keep on the top-level config is left out."""
    ids = {field: getattr(config, field, None) for field in TOKEN_ID_FIELDS}
    return {field: value for field, value in ids.items() if value is not None}


def build_default_model(output_dir: str | os.PathLike, *, seed: int = 0) -> Path:
    """Build the tiny default model, tokenizer and image processor into ``output_dir``.

    The weights are a function of ``seed`` only (``torch.manual_seed(seed)`` before init).
    Returns ``output_dir`` as a :class:`Path`. Existing files there are overwritten.
    """
    from transformers import GenerationConfig, Qwen2VLForConditionalGeneration

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    config = _config(tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2VLForConditionalGeneration(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(output_dir)
    _processor(tokenizer, _image_processor()).save_pretrained(output_dir)
    return output_dir


def cache_root() -> Path:
    """Where built checkpoints are kept: ``$ASCEND_VLM_CACHE``, default ``~/.cache/ascend_vlm``."""
    return Path(os.environ.get("ASCEND_VLM_CACHE", Path.home() / ".cache" / "ascend_vlm"))


def default_model_path(*, seed: int = 0) -> Path:
    """Local path of the default model for ``seed``, built on first use.

    The build goes to a temporary sibling directory that is renamed into place, so concurrent
    callers (e.g. several torchrun ranks) never see a half-written checkpoint.
    """
    target = cache_root() / f"{DEFAULT_MODEL_NAME}-seed{seed}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build_default_model(staging, seed=seed)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race to a complete build: fine
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


# Files of which a loadable tokenizer has at least one: the fast tokenizer's JSON, a
# SentencePiece model, or the vocabulary of a slow BPE / WordPiece tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
# An image processor is saved on its own or inside a processor's config.
IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def require_processor_files(path: str | os.PathLike, argument: str = "path") -> None:
    """Raise ``FileNotFoundError`` naming ``argument`` when the checkpoint folder ``path`` lacks
    a tokenizer (none of ``TOKENIZER_FILES``) or an image processor (``IMAGE_PROCESSOR_FILES``),
    saying how to add them; a folder written by ``model.save_pretrained`` alone has neither."""
    path = Path(path)
    missing = []
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"a tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    if not any((path / name).is_file() for name in IMAGE_PROCESSOR_FILES):
        missing.append(f"an image processor ({' or '.join(IMAGE_PROCESSOR_FILES)})")
    if missing:
        raise FileNotFoundError(
            f"{argument}: expected a checkpoint folder with {' and '.join(missing)}, {path} has "
            f"none; model.save_pretrained does not write them. Save the processor of the model "
            f"it came from into it: ascend_vlm.default_model.load_processor(BASE)"
            f".save_pretrained({str(path)!r})"
        )


def load_processor(path: str | os.PathLike):
    """The processor of a local checkpoint.

    Returns transformers' own processor when it can be built (``AutoProcessor``); for
    Qwen-VL-style checkpoints whose full processor needs torchvision, an
    :class:`ImageTextProcessor` over the checkpoint's tokenizer and image processor. Raises
    ``FileNotFoundError`` (:func:`require_processor_files`) when ``path`` has no tokenizer or
    no image processor.
    """
    from transformers import AutoProcessor
    from transformers.processing_utils import ProcessorMixin

    require_processor_files(path)

    try:
        with _without_subprocessor_class_notice():
            processor = AutoProcessor.from_pretrained(path)
    except (ValueError, AttributeError, ImportError, OSError):
        processor = None
    if isinstance(processor, ProcessorMixin):
        return processor
    return ImageTextProcessor.from_pretrained(path)


class _SubprocessorClassNotice(logging.Filter):
    """Drops transformers' notice that a processor class names its sub-processors' classes
    (``image_processor_class = 'AutoImageProcessor'``, as ``PaddleOCRVLProcessor`` does): the
    default model's folder needs that class (see the module docstring) and the notice, printed
    once per process and rank, asks the class's authors for a change, not the user."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("_class = " in message and "which is deprecated" in message)


@contextmanager
def _without_subprocessor_class_notice() -> Iterator[None]:
    logger = logging.getLogger("transformers.processing_utils")
    notice = _SubprocessorClassNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


def load_default_model(path: str | os.PathLike | None = None, **from_pretrained_kwargs: Any):
    """Load the default model (building it on first use when ``path`` is None).

    Returns ``(model, processor)``; the model is a ``Qwen2VLForConditionalGeneration`` loaded
    with ``from_pretrained(path, **from_pretrained_kwargs)`` and put in eval mode.
    """
    from transformers import Qwen2VLForConditionalGeneration

    path = Path(path) if path is not None else default_model_path()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"path: expected a saved checkpoint with config.json, got {path}")
    model = Qwen2VLForConditionalGeneration.from_pretrained(path, **from_pretrained_kwargs)
    return model.eval(), load_processor(path)


class ImageTextProcessor:
    """Tokenizer + Qwen-VL image processor, expanding each image placeholder to its tokens.

    Each ``<|image_pad|>`` in the text stands for one image (in order across the batch) and is
    replaced by ``t*h*w / merge_size**2`` copies of itself, where ``(t, h, w)`` is that image's
    ``image_grid_thw`` row. ``mm_token_type_ids`` (1 on image tokens, else 0) is returned as
    Qwen-VL's M-RoPE needs it.
    """

    def __init__(self, tokenizer, image_processor) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.image_token = IMAGE_TOKEN
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
        self.chat_template = tokenizer.chat_template

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> ImageTextProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path))

    def save_pretrained(self, path: str | os.PathLike) -> None:
        self.tokenizer.save_pretrained(path)
        self.image_processor.save_pretrained(path)

    def apply_chat_template(self, conversation, **kwargs: Any):
        return self.tokenizer.apply_chat_template(conversation, **kwargs)

    def batch_decode(self, sequences, **kwargs: Any) -> list[str]:
        return self.tokenizer.batch_decode(sequences, **kwargs)

    def decode(self, sequence, **kwargs: Any) -> str:
        return self.tokenizer.decode(sequence, **kwargs)

    def __call__(
        self,
        text: str | Sequence[str],
        images: Sequence[Any] | None = None,
        *,
        padding: bool | str = True,
        return_tensors: str = "pt",
        **tokenizer_kwargs: Any,
    ):
        """Tokenize ``text`` (one string or a batch) with ``images`` for its placeholders."""
        from transformers import BatchFeature

        texts = [text] if isinstance(text, str) else list(text)
        images = list(images or [])
        placeholders = sum(t.count(self.image_token) for t in texts)
        if placeholders != len(images):
            raise ValueError(
                f"images: expected one image per {self.image_token} placeholder in text "
                f"({placeholders}), got {len(images)} images"
            )
        data: dict[str, Any] = {}
        if images:
            vision = self.image_processor(images=images, return_tensors=return_tensors)
            data.update(vision)
            merge = self.image_processor.merge_size**2
            counts = iter((vision["image_grid_thw"].prod(-1) // merge).tolist())
            expanded = []
            for t in texts:
                pieces = t.split(self.image_token)
                out = pieces[0]
                for piece in pieces[1:]:
                    out += self.image_token * next(counts) + piece
                expanded.append(out)
            texts = expanded
        encoded = self.tokenizer(
            texts, padding=padding, return_tensors=return_tensors, **tokenizer_kwargs
        )
        data.update(encoded)
        data["mm_token_type_ids"] = (encoded["input_ids"] == self.image_token_id).int()
        return BatchFeature(data=data)
