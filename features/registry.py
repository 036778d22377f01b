"""The feature registry: enabled modules, per-batch plans and the matrix.

One registry per engine (no global state). It turns each module's declaration
into the overlap-compatibility matrix, decides the loop under the overlap
policy, and tells the scheduler which features a batch carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from service.core.feature import BatchView, Feature, FeatureContext, OverlapSupport
from service.core.request import RequestError

if TYPE_CHECKING:
    from service.core.request import Req

POLICIES = ("per-batch", "global", "strict")


@dataclass
class MatrixRow:
    feature: str
    overlap_support: str
    reason: str
    enabled: bool
    available: bool
    unavailable_reason: str
    batches_overlapped: int
    batches_fallback: int
    batches_normal_loop: int
    counters: dict[str, int] = field(default_factory=dict)  # the feature's own (Feature.counters)
    # Overlap-loop batches that waited anyway (not declared): the forward waited on the host for the
    # feature's work, or the results in flight were processed first for it. 0 for a feature truly full.
    batches_synced: int = 0


@dataclass
class _Counters:
    overlapped: int = 0
    fallback: int = 0
    normal_loop: int = 0
    synced: int = 0
    event_synced: int = 0  # sync points at the feature's declared event (Feature.sync_event)
    live_requests: int = 0  # requests using the feature, admitted and not finished


class FeatureRegistry:
    """Feature modules of one engine, with their switches and counters."""

    def __init__(self, features: list[Feature], disabled: list[str] | None = None, policy: str = "per-batch"):
        if policy not in POLICIES:
            raise ValueError(f"unknown overlap policy {policy!r} (one of {', '.join(POLICIES)})")
        self.features: dict[str, Feature] = {}
        for f in features:
            if not f.name or f.name in self.features:
                raise ValueError(f"feature names must be unique and non-empty: {f.name!r}")
            self.features[f.name] = f
        unknown = set(disabled or ()) - set(self.features)
        if unknown:
            raise ValueError(
                f"unknown feature(s) to disable: {', '.join(sorted(unknown))} (known: {', '.join(self.features) or 'none'})"
            )
        self.enabled = {name: name not in set(disabled or ()) for name in self.features}
        self.policy = policy
        self.counters = {name: _Counters() for name in self.features}
        self.model: FeatureContext | None = None  # set by bind: what unavailable_reason() is asked about

    def bind(self, ctx: FeatureContext) -> None:
        """Bind the enabled modules (a disabled one starts nothing, e.g. no grammar-init thread)."""
        self.model = ctx
        for f in self.enabled_features():
            f.bind(ctx)

    def enabled_features(self) -> list[Feature]:
        return [f for n, f in self.features.items() if self.enabled[n]]

    def resolve_overlap(self, want_overlap: bool) -> bool:
        """Whether the overlap loop runs, under the policy; `strict` refuses to start."""
        blockers = [f for f in self.enabled_features() if f.support is not OverlapSupport.FULL]
        if not want_overlap or not blockers:
            return want_overlap
        if self.policy == "strict":
            f = blockers[0]
            raise ValueError(
                f"--overlap-policy strict: enabled feature {f.name!r} cannot fully overlap ({f.support.value}: {f.reason}); "
                f"disable it with --disable-feature {f.name} or choose another policy"
            )
        return self.policy == "per-batch"  # global: one incompatible feature turns overlap off for all

    # ---- requests ----------------------------------------------------------------------
    def validate_request(
        self, features: dict[str, Any], ctx: FeatureContext, prompt_ids: list[int]
    ) -> dict[str, Any]:
        """Caller thread: refuse unknown, disabled or unavailable features; normalise payloads."""
        out = {}
        for name, payload in features.items():
            f = self.features.get(name)
            if f is None:
                raise RequestError("INVALID_ARGUMENT", f"unknown feature {name!r}")
            if not self.enabled[name]:
                raise RequestError("FAILED_PRECONDITION", f"feature {name!r} is disabled on this server")
            self._check_available(name, f)
            out[name] = f.validate(payload, ctx, prompt_ids)
        return out

    # ---- prompt hooks (multimodal) -----------------------------------------------------
    def expand_prompt(self, features: dict[str, Any], prompt_ids: list[int]) -> list[int]:
        """Caller thread, before validation: the prompt as the model sees it (e.g. images expanded).
        A payload for an unavailable feature is refused here already (FAILED_PRECONDITION)."""
        for name, f in self.features.items():
            if not self.enabled[name]:
                continue  # a payload for it is refused by validate_request
            payload = features.get(name)
            if payload is not None:
                self._check_available(name, f)
            prompt_ids = f.expand_prompt(payload, prompt_ids)
        return prompt_ids

    def _check_available(self, name: str, f: Feature) -> None:
        why = f.unavailable_reason(self.model)
        if why:
            raise RequestError(
                "FAILED_PRECONDITION", f"feature {name!r} is not available for this model: {why}"
            )

    def pending(self, req: "Req") -> list[Any]:
        """Caller thread: the futures the request should wait for before it is queued."""
        futures = [f.pending(req.features[f.name]) for f in self.features_of(req)]
        return [fut for fut in futures if fut is not None]

    def shutdown(self) -> None:
        for f in self.features.values():
            f.shutdown()

    def features_of(self, req: "Req") -> list[Feature]:
        return [self.features[n] for n in req.features if n in self.features]

    def ready(self, req: "Req") -> bool:
        """Whether every feature of the request lets it be scheduled now (may raise RequestError)."""
        return all(f.admission_ready(req) for f in self.features_of(req))

    def on_admit(self, req: "Req") -> None:
        for f in self.features_of(req):
            self.counters[f.name].live_requests += 1
            f.on_admit(req)

    def on_finish(self, req: "Req") -> dict[str, Any]:
        """Final output fields by feature name (e.g. the check of a constrained output)."""
        final = {}
        for f in self.features_of(req):
            self.counters[f.name].live_requests -= 1
            fields = f.on_finish(req)
            if fields:
                final[f.name] = fields
        return final

    # ---- prefix cache ------------------------------------------------------------------
    def max_cached_prefix(self, req: "Req") -> int | None:
        """The tightest limit the request's features put on its cached prefix (None: none)."""
        limits = [n for n in (f.max_cached_prefix(req) for f in self.features_of(req)) if n is not None]
        return min(limits) if limits else None

    # ---- batches -----------------------------------------------------------------------
    def plan(
        self, reqs: list["Req"], partial_rows: frozenset[int] = frozenset()
    ) -> list[tuple[Feature, list[int]]]:
        """(feature, active rows) for each feature some row of the batch uses. `partial_rows`
        (non-final prompt chunks) count only for features that read prompt chunks."""
        plan = []
        for name, f in self.features.items():
            if self.counters[name].live_requests == 0:
                continue  # cheap path: nobody uses it right now
            skip = frozenset() if f.reads_prompt_chunks else partial_rows
            rows = [i for i, r in enumerate(reqs) if i not in skip and f.active_for(r)]
            if rows:
                plan.append((f, rows))
        return plan

    def count(self, plan: list[tuple[Feature, list[int]]], how: str) -> None:
        """how: 'overlapped', 'fallback' or 'normal_loop'."""
        for f, _ in plan:
            c = self.counters[f.name]
            setattr(c, how, getattr(c, how) + 1)

    def count_waits(self, batch: "BatchView", plan: list[tuple[Feature, list[int]]]) -> None:
        """Scheduler thread, once an overlap-loop batch's result is processed: each feature whose hooks
        made its forward wait on the host (`Feature.waited_on_host`) counts it as synced."""
        for f, _ in plan:
            if f.waited_on_host(batch):
                self.counters[f.name].synced += 1

    def count_event_sync(self, name: str) -> None:
        """A sync point at the feature's declared event (`Feature.sync_event`), e.g. retraction
        processing the results in flight before its victims are retracted."""
        if name in self.counters:
            self.counters[name].event_synced += 1

    # ---- scheduler-attached features (retraction) -------------------------------------------
    def enabled_feature(self, name: str) -> Feature | None:
        f = self.features.get(name)
        return f if f is not None and self.enabled[name] else None

    def attach(self, req: "Req", name: str, payload: Any) -> None:
        """The scheduler gives an admitted request a feature's payload (e.g. once it was retracted):
        from now on it is live for that feature, as if it had been admitted with it."""
        if name not in req.features and name in self.counters:
            self.counters[name].live_requests += 1
        req.features[name] = payload

    def on_retract(self, req: "Req") -> None:
        """The request lost its KV and will be re-prefilled from prompt + kept tokens."""
        for f in self.features_of(req):
            f.on_retract(req)

    # ---- the matrix --------------------------------------------------------------------
    def matrix(self) -> list[MatrixRow]:
        rows = []
        for name, f in self.features.items():
            why = f.unavailable_reason(self.model) if self.model is not None else None
            c = self.counters[name]
            rows.append(
                MatrixRow(
                    name,
                    f.support.value,
                    f.reason,
                    self.enabled[name],
                    why is None,
                    why or "",
                    c.overlapped,
                    c.fallback,
                    c.normal_loop,
                    f.counters() | ({"event_syncs": c.event_synced} if f.sync_event else {}),
                    c.synced,
                )
            )
        return rows


def support_of(plan: list[tuple[Feature, list[int]]]) -> OverlapSupport:
    """The weakest overlap support among a batch's features (FULL when none)."""
    worst = OverlapSupport.FULL
    for f, _ in plan:
        if f.support.rank > worst.rank:
            worst = f.support
    return worst


def render_matrix_markdown(features: list[Feature], column: tuple[str, dict[str, str]] | None = None) -> str:
    """The README table, from the declarations; `column` (title, cell by feature name) adds one
    more, e.g. what a measurement found (service/matrix.py --measured)."""
    title, cells = column if column is not None else ("", {})
    extra = f" {title} |" if column is not None else ""
    lines = [
        "| feature | overlap support | why |" + extra,
        "|---|---|---|" + ("---|" if column is not None else ""),
    ]
    for f in features:
        cell = f" {cells.get(f.name, 'not measured')} |" if column is not None else ""
        lines.append(f"| {f.name} | {f.declared_support()} | {f.reason} |" + cell)
    if not features:
        lines.append("| _(no feature modules yet)_ | | |" + (" |" if column is not None else ""))
    return "\n".join(lines)
