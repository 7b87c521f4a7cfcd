"""Images of many sizes, aspect ratios and modes, made here (nothing binary is committed),
for the preprocessors' equality tests."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def noise(height: int, width: int, channels: int = 3, seed: int = 0) -> np.ndarray:
    shape = (height, width) if channels == 1 else (height, width, channels)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def encoded(image: Image.Image, format: str, **options) -> Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, format=format, **options)
    buffer.seek(0)
    return Image.open(buffer)


def corpus() -> list:
    rgb = Image.fromarray(noise(120, 90))
    sixteen_bit = Image.fromarray(noise(40, 60, 1).astype(np.uint16) * 257)
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE)
    palette.info["transparency"] = 3
    keyed_pixels = noise(30, 40, seed=10)
    keyed_pixels[:10, :10] = 0  # the transparent colour occurs
    keyed = Image.fromarray(keyed_pixels)
    keyed.info["transparency"] = (0, 0, 0)
    return [
        Image.fromarray(noise(1, 1)),  # 1x1: grown to the minimum area
        Image.fromarray(noise(20, 3000, seed=1)),  # very wide (150:1)
        Image.fromarray(noise(900, 60, seed=2)),  # tall
        Image.fromarray(noise(448, 448, seed=3)),
        Image.fromarray(noise(1000, 700, seed=4)),  # above the pixel limit: shrunk
        Image.fromarray(noise(57, 83, 1, seed=5)),  # grayscale
        Image.fromarray(noise(64, 48, 4, seed=6)),  # RGBA: transparency onto white
        Image.fromarray(noise(50, 70, 2, seed=7)),  # LA
        palette,  # palette with a transparent index
        keyed,  # RGB with a transparent colour key
        encoded(rgb.convert("CMYK"), "JPEG"),  # CMYK JPEG
        encoded(sixteen_bit, "PNG"),  # 16-bit PNG
        noise(77, 131, seed=8),  # a uint8 HxWxC array
    ]


def saved_files(folder) -> list[str]:
    """Image files of several kinds written into ``folder``: paths as a user passes them."""
    rgb = Image.fromarray(noise(60, 90, seed=11))
    paths = []
    for name, image, options in [
        ("plain.png", rgb, {}),
        ("rgba.png", Image.fromarray(noise(40, 50, 4, seed=12)), {}),
        ("gray.jpg", Image.fromarray(noise(70, 30, 1, seed=13)), {}),
    ]:
        image.save(folder / name, **options)
        paths.append(str(folder / name))
    palette = rgb.convert("P", palette=Image.Palette.ADAPTIVE)
    palette.save(folder / "palette.png", transparency=3)
    paths.append(str(folder / "palette.png"))
    for orientation in (3, 6, 8):  # rotated 180, 90 and 270 degrees by its EXIF tag
        exif = rgb.getexif()
        exif[0x0112] = orientation
        rgb.save(folder / f"exif{orientation}.jpg", exif=exif)
        paths.append(str(folder / f"exif{orientation}.jpg"))
    return paths
