"""OpenAI-compatible HTTP gateway in front of the gRPC generation service
(`python -m service gateway --grpc ADDR --port 8000`)."""
