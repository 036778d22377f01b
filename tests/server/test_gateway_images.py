"""Images through the OpenAI gateway (official SDK) and the client library's image parts, on a tiny LLaVA."""

from __future__ import annotations

import base64
import contextlib
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from PIL import Image as PILImage

from service.config import ServerArgs
from service.gateway import protocol
from service.gateway.errors import APIError
from service.server import BackgroundServer
from tests.features.test_multimodal import IMAGES
from tests.server.test_gateway import run_gateway
from zerogap.client import Client, Image, Sampling, ZerogapError

GREEDY = Sampling(max_new_tokens=6, temperature=0, ignore_eos=True)


@contextlib.contextmanager
def image_host(files: dict[str, bytes]) -> Iterator[str]:
    """A local HTTP server answering GET /NAME with files[NAME] (404 otherwise)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            body = files.get(self.path.lstrip("/"))
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def stack(tiny_llava_dir):
    server = BackgroundServer(
        ServerArgs(
            model=str(tiny_llava_dir), port=0, dtype="float32", kv_cache_tokens=2000, max_running_requests=4
        )
    )
    try:
        with (
            image_host({"a.png": IMAGES[0], "big.png": IMAGES[4] + bytes(150_000)}) as host,
            run_gateway(
                server.address, "--allow-image-urls", "127.0.0.1", "--image-url-max-bytes", "100000"
            ) as gw,
        ):
            yield server, gw, host
    finally:
        server.stop()


def data_uri(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def test_image_url_parts_equal_the_grpc_call_and_client_helpers(stack, tmp_path):
    """A data: URI (PNG, JPEG) and an allowed URL give the tokens of the gRPC call with the same bytes;
    the client's parts from bytes, a path and a PIL image are the same image."""
    server, gw, host = stack
    (tmp_path / "b.jpg").write_bytes(IMAGES[1])
    with Client(server.address) as zg, openai.OpenAI(base_url=gw + "/v1", api_key="-", max_retries=0) as oai:
        model = oai.models.list().data[0].id

        def sdk(*parts) -> str:
            content = [{"type": "text", "text": "Look: "}, *parts, {"type": "text", "text": " what?"}]
            r = oai.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": content}],
                max_tokens=6,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return r.choices[0].message.content

        def grpc(*images) -> str:
            return zg.chat([("user", ["Look: ", *images, " what?"])], GREEDY).text

        a = grpc(IMAGES[0])
        assert sdk({"type": "image_url", "image_url": {"url": data_uri(IMAGES[0])}}) == a
        assert sdk({"type": "image_url", "image_url": {"url": host + "/a.png"}}) == a
        assert grpc(PILImage.open(__import__("io").BytesIO(IMAGES[0]))) == a  # PIL -> PNG: same pixels
        b = grpc(Path(tmp_path / "b.jpg"))
        assert b == grpc(Image(IMAGES[1])) != a
        assert sdk({"type": "image_url", "image_url": {"url": data_uri(IMAGES[1], "jpeg")}}) == b
        with pytest.raises(ZerogapError) as e:
            grpc(b"not an image")
        assert e.value.code().name == "INVALID_ARGUMENT" and "images[0]" in e.value.details()

        def refused(url: str) -> openai.BadRequestError:
            with pytest.raises(openai.BadRequestError) as e:
                sdk({"type": "image_url", "image_url": {"url": url}})
            return e.value

        err = refused("https://example.com/cat.png")
        assert err.body["param"] == "messages[0].content[1].image_url" and "--allow-image-urls" in err.message
        assert "404" in refused(host + "/missing.png").message
        assert "exceed" in refused(host + "/big.png").message  # over --image-url-max-bytes
        assert "base64" in refused("data:image/png;base64,@@@").message
        assert "images[0]" in refused(data_uri(b"GIF89a not an image")).message  # the service's check


def test_parse_chat_image_parts():
    png = data_uri(IMAGES[0])
    body = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": png}}],
            },
            {"role": "user", "content": [{"type": "image_url", "image_url": "http://Pics.example/x.png"}]},
        ],
    }
    call = protocol.parse_chat(body, image_hosts=frozenset({"pics.example"}))
    (_, first), (_, second) = call.prompt.messages
    assert first == ["a", Image(IMAGES[0])]
    assert (
        protocol.remote_images(call) == [second[0]] and second[0].param == "messages[1].content[0].image_url"
    )
    fetched = protocol.with_images(call, {second[0].param: b"xyz"})
    assert fetched.prompt.messages[1][1] == [Image(b"xyz")] and not protocol.remote_images(fetched)
    for url, why in [
        ("http://pics.example/x.png", "allowed hosts: none"),
        ("ftp://pics.example/x.png", "http(s)"),
        ("data:image/gif;base64,R0lG", "image/gif"),
        ("data:image/png,plain", "base64"),
    ]:
        with pytest.raises(APIError) as e:
            protocol.parse_chat(
                {
                    "model": "m",
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}
                    ],
                }
            )
        assert e.value.status == 400 and why in e.value.message
