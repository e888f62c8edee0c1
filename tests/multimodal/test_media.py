"""Image URLs fetched over http(s) as vLLM does for chat `image_url` parts: from a loopback HTTP server,
an image comes back decoded; a missing one, a server that does not answer in time, a body past the size
limit and bytes that are no image are each a ValueError naming the problem (the server's 400)."""

from __future__ import annotations

import functools
import http.server
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedrs.multimodal import media
from tests.multimodal.helpers_vision import random_image


class _Slow(http.server.SimpleHTTPRequestHandler):
    def do_GET(self) -> None:  # http.server's name
        if self.path.startswith("/slow"):
            time.sleep(1.0)
        super().do_GET()

    def log_message(self, *args: object) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that gave up (the timeout and size cases) is expected here


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("media")
    random_image(30, 40, seed=5).save(root / "a.png")
    (root / "slow.png").write_bytes((root / "a.png").read_bytes())
    (root / "text.png").write_bytes(b"not an image at all")
    server = _Server(("127.0.0.1", 0), functools.partial(_Slow, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_image_and_its_failures(base_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    img = media.fetch_image(f"{base_url}/a.png")
    assert img.size == (40, 30)
    with pytest.raises(ValueError, match="HTTP 404"):
        media.fetch_image(f"{base_url}/missing.png")
    with pytest.raises(ValueError, match="cannot be decoded"):
        media.fetch_image(f"{base_url}/text.png")
    monkeypatch.setattr(media, "FETCH_TIMEOUT_S", 0.2)
    with pytest.raises(ValueError, match="cannot be fetched: .*Timeout"):
        media.fetch_image(f"{base_url}/slow.png")
    monkeypatch.setattr(media, "MAX_IMAGE_BYTES", 64)
    with pytest.raises(ValueError, match="larger than 64 bytes"):
        media.fetch_image(f"{base_url}/a.png")
    with pytest.raises(ValueError, match="cannot be fetched"):
        media.fetch_image("http://127.0.0.1:9/a.png")  # nothing listens on the discard port
