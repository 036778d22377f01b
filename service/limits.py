"""Input limits checked before anything else is done with a request (flags with safe defaults).

Message size is gRPC's own (RESOURCE_EXHAUSTED); the fields below are refused
with INVALID_ARGUMENT naming the field and the flag. Grammar limits live in
features/grammar_backend.py, prompt length against the context in the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from service.core.request import RequestError


@dataclass(frozen=True)
class InputLimits:
    max_request_id_bytes: int = 256
    max_stop_strings: int = 16
    max_stop_string_bytes: int = 256
    max_stop_token_ids: int = 64

    @classmethod
    def from_args(cls, args: Any) -> "InputLimits":
        return cls(
            args.max_request_id_bytes,
            args.max_stop_strings,
            args.max_stop_string_bytes,
            args.max_stop_token_ids,
        )

    def check(self, request_id: str, sampling: Any, field: str = "sampling") -> None:
        """Raise RequestError(INVALID_ARGUMENT) for the first field beyond its limit. `sampling`: the
        request's sampling message (its `stop` and `stop_token_ids`), named `field` in the contract."""
        stop, stop_token_ids = sampling.stop, sampling.stop_token_ids
        rid = len(request_id.encode("utf-8", "surrogatepass"))
        if rid > self.max_request_id_bytes:
            raise _over("request_id", f"{rid} bytes", self.max_request_id_bytes, "--max-request-id-bytes")
        if len(stop) > self.max_stop_strings:
            raise _over(f"{field}.stop", f"{len(stop)} strings", self.max_stop_strings, "--max-stop-strings")
        longest = max((len(s.encode("utf-8", "surrogatepass")) for s in stop), default=0)
        if longest > self.max_stop_string_bytes:
            raise _over(
                f"{field}.stop",
                f"a string of {longest} bytes",
                self.max_stop_string_bytes,
                "--max-stop-string-bytes",
            )
        if len(stop_token_ids) > self.max_stop_token_ids:
            raise _over(
                f"{field}.stop_token_ids",
                f"{len(stop_token_ids)} ids",
                self.max_stop_token_ids,
                "--max-stop-token-ids",
            )


def _over(field: str, what: str, limit: int, flag: str) -> RequestError:
    return RequestError("INVALID_ARGUMENT", f"{field}: {what} exceed the limit of {limit} ({flag})")
