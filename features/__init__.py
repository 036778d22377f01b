"""Feature modules: each declares its overlap support and the hooks it needs.

See `service/core/feature.py` for the interface and `features/registry.py` for the
registry that builds the compatibility matrix. Built-in modules are listed in
`BUILTIN_FEATURES`; the feature issues (logprobs, constrained decoding,
retraction, mixed chunked prefill, multimodal) each add one module here.
"""

from features.registry import FeatureRegistry, builtin_features
from service.core.feature import Feature, OverlapSupport

__all__ = ["Feature", "FeatureRegistry", "OverlapSupport", "builtin_features"]
