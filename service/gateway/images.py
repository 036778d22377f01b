"""Fetching an allowed remote image (`--allow-image-urls`), bounded in bytes and time.

Runs in a worker thread (never on the event loop). Redirects are not followed: a redirect
could lead to a host that was not allowed. The bytes are checked by the generation service
like any other image (format, size, pixels).
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request


class FetchError(ValueError):
    """Why a remote image could not be used."""


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D102 (urllib's hook)
        raise FetchError(f"the server redirects ({code}) to {newurl}; redirects are not followed")


_OPENER = urllib.request.build_opener(_NoRedirects)


def fetch_image(url: str, max_bytes: int, timeout_s: float) -> bytes:
    """The body at `url`, at most max_bytes, within timeout_s overall; FetchError otherwise."""
    deadline = time.monotonic() + timeout_s
    try:
        with _OPENER.open(url, timeout=timeout_s) as r:
            length = r.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise FetchError(f"{length} bytes exceed the limit of {max_bytes}")
            chunks, size = [], 0
            while chunk := r.read(64 << 10):
                size += len(chunk)
                if size > max_bytes:
                    raise FetchError(f"more than {max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise FetchError(f"not fetched within {timeout_s:g} s")
                chunks.append(chunk)
            return b"".join(chunks)
    except FetchError:
        raise
    except urllib.error.HTTPError as e:
        raise FetchError(f"HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise FetchError(f"cannot fetch it ({reason})") from None
