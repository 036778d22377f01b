"""Feature modules: each declares its overlap support and the hooks it needs.

This package holds the request-level plugins (logprobs, constrained decoding, multimodal input,
retraction's request side) and the registry that builds the compatibility matrix; the interface is
`service/core/feature.py`. Engine mechanisms (chunked prefill, the prefix cache) declare their
matrix rows next to their code; `service/engine/modules.py` lists every module in matrix order.
"""

from features.registry import FeatureRegistry
from service.core.feature import Feature, OverlapSupport

__all__ = ["Feature", "FeatureRegistry", "OverlapSupport"]
