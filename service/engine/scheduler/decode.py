"""Decode formation: one token for every running request that still needs one."""

from __future__ import annotations

from service.core.device import Device
from service.core.request import Req
from service.engine.kv_cache import ReqToTokenPool, TokenToKVPool
from service.engine.schedule_batch import ScheduleBatch, build_decode_batch
from service.engine.scheduler.admission import AdmissionPolicy
from service.engine.scheduler.retraction import Retraction


class DecodeManager:
    def __init__(
        self,
        running: list[Req],
        policy: AdmissionPolicy,
        retraction: Retraction,
        req_pool: ReqToTokenPool,
        kv_pool: TokenToKVPool,
        vocab_size: int,
        device: Device,
    ):
        self.running = running
        self.policy, self.retraction = policy, retraction
        self.req_pool, self.kv_pool, self.vocab_size, self.device = req_pool, kv_pool, vocab_size, device

    def form(self) -> ScheduleBatch | None:
        self.retraction.make_room_for_decode()  # retraction: every request below gets a KV row
        reqs = [r for r in self.running if r.launched < r.max_new_tokens]
        if not reqs:
            return None
        self.policy.on_decode_step()
        return build_decode_batch(reqs, self.req_pool, self.kv_pool, self.vocab_size, self.device)
