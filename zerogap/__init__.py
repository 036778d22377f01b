"""zerogap's Python client side: `zerogap.client` (sync and asyncio clients).

The generated gRPC stubs live under `zerogap.v1` (`generation_pb2`,
`generation_pb2_grpc`). They are built from proto/ on first use into the
service's generated-code folder (see service/protos.py), which this package
adds to its own search path so that `zerogap.v1` resolves there.
"""

from service import protos as _protos

__path__.append(str(_protos.GEN_DIR / "zerogap"))  # noqa: F821 (a package's __path__)
