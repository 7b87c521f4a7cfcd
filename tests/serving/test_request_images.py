"""Image sources under the server's rules: data URLs always; local files only under the named
directory (no escape by ``..`` or symlink); http(s) URLs only when allowed, with a size cap;
a pixel limit read from the header. Every refusal names the field and the flag."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time

import pytest
from PIL import Image

from ascend_vlm.serving.errors import ApiError
from ascend_vlm.serving.images import decoded_image_cache, read_image
from ascend_vlm.serving.limits import ServingLimits

FIELD = "messages.0.content.0.image_url.url"


def _png(size=(8, 6), colour="red") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _refusal(url: str, limits: ServingLimits) -> str:
    with pytest.raises(ApiError) as raised:
        read_image(url, FIELD, limits)
    assert raised.value.status == 400 and raised.value.param == FIELD
    assert raised.value.message.startswith(f"{FIELD}: ")
    return raised.value.message


def test_data_urls_are_read_and_pixels_are_limited():
    url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    assert read_image(url, FIELD, ServingLimits()).size == (8, 6)
    assert "8x6 pixels, more than --max-image-pixels (47)" in _refusal(
        url, ServingLimits(max_image_pixels=47)
    )
    assert "base64" in _refusal("data:image/png;base64,***", ServingLimits())
    assert "data:image/<type>;base64" in _refusal("data:text/plain,hello", ServingLimits())


def test_local_files_only_under_the_named_directory(tmp_path):
    root, outside = tmp_path / "images", tmp_path / "secret"
    root.mkdir()
    outside.mkdir()
    (root / "cat.png").write_bytes(_png())
    (outside / "key.png").write_bytes(_png())
    (root / "link.png").symlink_to(outside / "key.png")
    assert "--allow-local-images" in _refusal("cat.png", ServingLimits())
    limits = ServingLimits(local_images=root)
    assert read_image("cat.png", FIELD, limits).size == (8, 6)
    assert read_image(f"file://{root}/cat.png", FIELD, limits).size == (8, 6)
    for escape in ("../secret/key.png", str(outside / "key.png"), "link.png"):
        assert "expected a file under" in _refusal(escape, limits)
    assert "no such image file" in _refusal("dog.png", limits)


def test_urls_only_when_allowed_and_capped(loopback_http):
    folder, url = loopback_http
    (folder / "small.png").write_bytes(_png())
    (folder / "large.png").write_bytes(_png((600, 600)) + bytes(2 << 20))
    assert "--allow-image-urls" in _refusal(f"{url}/small.png", ServingLimits())
    allowed = ServingLimits(allow_image_urls=True, url_max_bytes=1 << 20)
    assert read_image(f"{url}/small.png", FIELD, allowed).size == (8, 6)
    assert "larger than --image-url-max-mib" in _refusal(f"{url}/large.png", allowed)
    assert "cannot fetch" in _refusal(f"{url}/missing.png", allowed)


def test_local_files_are_capped_and_read_once(tmp_path, monkeypatch):
    (tmp_path / "cat.png").write_bytes(_png())
    (tmp_path / "large.png").write_bytes(_png((600, 600)) + bytes(2 << 20))
    limits = ServingLimits(local_images=tmp_path, url_max_bytes=1 << 20)
    assert "the image file" in _refusal("large.png", limits)
    assert "larger than --image-url-max-mib" in _refusal("large.png", limits)
    opened = []
    real_open = open

    def counting_open(file, *args, **kwargs):
        if str(file).endswith("cat.png"):
            opened.append(file)
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)
    assert read_image("cat.png", FIELD, limits).size == (8, 6)
    assert len(opened) == 1


class _SlowImage(http.server.BaseHTTPRequestHandler):
    """Answers every GET with a PNG body sent two bytes every 50 ms: each socket read is
    quick, the whole fetch is slow."""

    def do_GET(self):
        body = _png()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        for start in range(0, len(body), 2):
            self.wfile.write(body[start : start + 2])
            self.wfile.flush()
            time.sleep(0.05)

    def log_message(self, *args):
        pass


def test_the_url_timeout_bounds_the_whole_fetch():
    site = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SlowImage)
    site.daemon_threads = True
    threading.Thread(target=site.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{site.server_address[1]}/slow.png"
        limits = ServingLimits(allow_image_urls=True, url_timeout=0.5)
        assert "within --image-url-timeout (0.5 s)" in _refusal(url, limits)
        patient = ServingLimits(allow_image_urls=True, url_timeout=60)
        assert read_image(url, FIELD, patient).size == (8, 6)
    finally:
        site.shutdown()
        site.server_close()


def test_decoded_images_are_kept_by_content():
    cache = decoded_image_cache(1 << 20)
    url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    first = read_image(url, FIELD, ServingLimits(), cache)
    assert read_image(url, FIELD, ServingLimits(), cache) is first
    other = "data:image/png;base64," + base64.b64encode(_png(colour="blue")).decode()
    assert read_image(other, FIELD, ServingLimits(), cache).getpixel((0, 0)) == (0, 0, 255)
    assert (cache.hits, cache.misses, len(cache)) == (1, 2, 2)
    assert first.getpixel((0, 0)) == (255, 0, 0)


def test_content_keys_keep_apart_what_the_cache_must_not_merge(tmp_path):
    from ascend_vlm.data.content_keys import vouched_content_key

    cache = decoded_image_cache(1 << 20)
    limits = ServingLimits(local_images=tmp_path)
    url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    image = read_image(url, FIELD, limits, cache)
    # A file whose bytes spell that data URL is no image, with the URL cached or not.
    (tmp_path / "spelled.png").write_text(url)
    with pytest.raises(ApiError, match="cannot read an image"):
        read_image("spelled.png", FIELD, limits, cache)
    # The same pixels in other bytes: another key (a miss, never a wrong hit).
    buffer = io.BytesIO()
    Image.new("RGB", (8, 6), "red").save(buffer, format="PNG", compress_level=0)
    (tmp_path / "other.png").write_bytes(buffer.getvalue())
    other = read_image("other.png", FIELD, limits, cache)
    assert vouched_content_key(other) not in (None, vouched_content_key(image))
    assert other.tobytes() == image.tobytes()
    assert (cache.hits, cache.misses) == (0, 3)
