"""The feature modules an engine serves, in the matrix's order."""

from __future__ import annotations

import logging

from service.core.feature import Feature
from service.engine.cache_manager import PrefixCacheFeature
from service.engine.chunking import ChunkedPrefill


def builtin_features() -> list[Feature]:
    """The feature modules shipped with zerogap, in matrix order: the request-level plugins of
    features/ and the engine mechanisms' declarations (chunking.py, cache_manager.py). A module whose
    library is not installed (e.g. xgrammar on a bare GPU box) is left out, with a warning."""
    from features.logprobs import LogprobsFeature
    from features.multimodal import MultimodalFeature

    features: list[Feature] = [LogprobsFeature()]
    try:
        from features.constrained import ConstrainedDecoding
    except ImportError as e:
        logging.getLogger("zerogap.features").warning("constrained decoding unavailable: %s", e)
    else:
        features.append(ConstrainedDecoding())
    features.append(ChunkedPrefill())
    features.append(MultimodalFeature())
    features.append(PrefixCacheFeature())
    from features.retraction import RetractionFeature

    features.append(RetractionFeature())
    return features
