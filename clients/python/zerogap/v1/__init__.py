"""Generated gRPC stubs of proto/zerogap/v1 (never hand-edited: clients/python/generate_stubs.py)."""
