"""zerogap's Python client: `Client` (blocking) and `AsyncClient` (asyncio).

    from zerogap.client import Client

    with Client("localhost:50051") as c:
        c.health()                                                      # "SERVING"
        c.chat([{"role": "user", "content": "Hi!"}], max_new_tokens=32, temperature=0).text
        for d in c.stream("Once upon a time", max_new_tokens=32):      # Deltas as they arrive
            print(d.text, end="")
        c.json("A person:", {"type": "object", "properties": {"name": {"type": "string"}}})
        c.chat([("user", ["What is this?", Path("cat.jpg")])], max_new_tokens=32)  # image parts: bytes,
                                                                        # a Path, a PIL image, Image

Errors raise ZerogapError (a grpc.RpcError: .code(), .details()).
"""

from zerogap.client.aio import AsyncClient, AsyncStream
from zerogap.client.channel import ChannelOptions, RetryPolicy
from zerogap.client.sync import Client, Stream
from zerogap.client.types import (
    GREEDY,
    Chat,
    Completion,
    Constraint,
    ConstraintIssue,
    ConstraintResult,
    Delta,
    Image,
    Logprobs,
    Message,
    Sampling,
    TokenLogprob,
    TopLogprob,
    ZerogapError,
    image,
)

__all__ = [
    "GREEDY",
    "AsyncClient",
    "AsyncStream",
    "ChannelOptions",
    "Chat",
    "Client",
    "Completion",
    "Constraint",
    "ConstraintIssue",
    "ConstraintResult",
    "Delta",
    "Image",
    "Logprobs",
    "Message",
    "RetryPolicy",
    "Sampling",
    "Stream",
    "TokenLogprob",
    "TopLogprob",
    "ZerogapError",
    "image",
]
