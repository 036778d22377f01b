"""zerogap's Python client (the `zerogap-client` distribution: grpcio and protobuf, no server).

`zerogap.client` holds the sync and asyncio clients; `zerogap.v1` the gRPC stubs generated from
proto/zerogap/v1/generation.proto (shipped generated; `generate_stubs.py` rebuilds them and a test
checks they are fresh).
"""
