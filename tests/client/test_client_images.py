"""The client library's image parts, without a server: what each kind of part becomes on the wire."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from PIL import Image as PILImage

from zerogap.client import Chat, Image, Message, image
from zerogap.client.types import build_request


def test_image_parts_from_bytes_a_path_and_a_pil_image(tmp_path: Path):
    pil = PILImage.new("RGB", (3, 2), (10, 200, 30))
    (tmp_path / "x.png").write_bytes(b"\x89PNG file")
    chat = Chat(
        [
            ("system", "Be brief."),
            Message(
                "user", ["Look: ", b"raw", tmp_path / "x.png", pil, {"type": "image", "image": Image(b"i")}]
            ),
            {"role": "user", "content": [{"type": "text", "text": "and?"}]},
        ]
    )
    req = build_request(chat)
    system, user, second = req.chat.messages
    assert system.content == "Be brief." and not system.parts
    kinds = [p.WhichOneof("part") for p in user.parts]
    assert kinds == ["text", "image", "image", "image", "image"]
    assert [p.image for p in user.parts[1:3]] + [user.parts[4].image] == [b"raw", b"\x89PNG file", b"i"]
    assert PILImage.open(io.BytesIO(user.parts[3].image)).getpixel((2, 1)) == (10, 200, 30)  # PNG: lossless
    assert [p.text for p in second.parts] == ["and?"]
    assert image(Image.from_pil(pil, format="JPEG")).data[:2] == b"\xff\xd8"


def test_a_str_is_text_and_other_objects_are_refused():
    assert build_request([("user", ["a/path.png"])]).chat.messages[0].parts[0].text == "a/path.png"
    with pytest.raises(TypeError, match="bytes, a path or a PIL image"):
        image(42)
    with pytest.raises(ValueError, match="unknown content part type"):
        build_request([("user", [{"type": "audio", "audio": b""}])])
