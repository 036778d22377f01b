"""Plain carriers every other layer builds on; this package imports nothing else of the project.

- `request`: a request's sampling settings, state and outputs (`Req`, `SamplingParams`,
  `RequestOutput`, `RequestError`, `FinishReason`, `OutputSink`)
- `forward_batch`: what one forward reads and returns (`ForwardBatch`, `ForwardMode`,
  `SamplingBatch`, `BatchResult`, `LogitsOutput`)
- `feature`: the feature-module interface (`Feature`, `OverlapSupport`, the typed `BatchView`)
- `device`: the device, its streams and events (`Device`, `CPU`)
- `text`: streamed text (`IncrementalDetokenizer`, `StopStringMatcher`)
"""
