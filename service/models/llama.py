"""The Llama family for packed batches: Llama, SmolLM, Mistral, Qwen2.

Hidden states are packed [T, hidden] across the batch's requests; attention
reads and writes the paged KV pool through an attention backend. Weights are
fused at load time (qkv, gate+up) so each layer runs four matmuls.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from service.core.forward_batch import ForwardBatch
from service.models.attention import AttentionMeta, TorchAttention
from service.models.linear import PackedLinear, pack_linear, packed_if_exact
from service.models.ops import add_rms_norm, silu_mul, split_qkv_rope
from service.models.qwen_vl import mrope_section

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelShape:
    """The numbers the engine needs about a model (KV pool sizing, limits)."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None = None  # attend to at most this many most recent positions

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        attention_bias = bool(getattr(config, "attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        window = getattr(config, "sliding_window", None)
        if is_qwen2 and not getattr(config, "use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_q_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(config, "max_position_embeddings", 2048),
            sliding_window=int(window) if window else None,
        )


def rope_cos_sin(config, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim], with the model's rope scaling."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        inv_freq = inv_freq.to(torch.float64)
    t = torch.arange(max_positions, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq).float()
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def mrope_cos_sin(
    cos_table: torch.Tensor, sin_table: torch.Tensor, positions: torch.Tensor, section: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cos/sin [T, head_dim] for M-RoPE: frequency band i (of `section`, over half the head)
    turns by the position of stream i % 3 (time, height, width); the second half repeats the first."""
    col = torch.arange(sum(section), device=positions.device)  # no host copy: scalar comparisons only
    band = sum((col >= edge).long() for edge in itertools.accumulate(section[:-1]))
    stream = torch.cat([band % 3, band % 3])
    t, d = positions.shape[1], stream.shape[0]
    pick = stream.view(1, 1, d).expand(1, t, d)
    return (
        cos_table[positions].gather(0, pick).squeeze(0),
        sin_table[positions].gather(0, pick).squeeze(0),
    )


class DecoderLayer(nn.Module):
    def __init__(self, s: ModelShape):
        super().__init__()
        self.s = s
        q, kv = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.qkv = nn.Linear(s.hidden_size, q + 2 * kv, bias=s.qkv_bias)
        self.o = nn.Linear(q, s.hidden_size, bias=s.o_bias)
        self.gate_up = nn.Linear(s.hidden_size, 2 * s.intermediate_size, bias=False)
        self.down = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)
        self.input_norm = nn.Parameter(torch.ones(s.hidden_size))
        self.post_norm = nn.Parameter(torch.ones(s.hidden_size))
        self.split = (q, kv, kv)
        self.scale = s.head_dim**-0.5

    def forward(
        self,
        h,
        delta,
        positions,
        cos_table,
        sin_table,
        k_cache,
        v_cache,
        meta: AttentionMeta,
        attn: TorchAttention,
    ):
        """(h, delta) -> the next layer's (h, delta): the residual add of each block is
        deferred into the next norm (h + delta, then RMSNorm, in one pass)."""
        s = self.s
        h, x = add_rms_norm(h, delta, self.input_norm, s.rms_norm_eps)
        q, k, v = split_qkv_rope(
            self.qkv(x), s.num_q_heads, s.num_kv_heads, s.head_dim, positions, cos_table, sin_table
        )
        a = attn.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        h, x = add_rms_norm(h, self.o(a), self.post_norm, s.rms_norm_eps)
        return h, self.down(silu_mul(self.gate_up(x)))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head over packed tokens."""

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.shape = s = ModelShape.from_config(config)
        self.embed = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(s) for _ in range(s.num_layers))
        self.norm = nn.Parameter(torch.ones(s.hidden_size))
        self.lm_head = None if s.tie_word_embeddings else nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        self.config = config
        self.max_positions = max_positions
        self.cos = self.sin = torch.empty(0)  # filled by init_rope() on the real device
        self.packed_head: PackedLinear | None = None  # pack_weights(): the LM head laid out for oneDNN
        self.mrope = mrope_section(config)  # M-RoPE bands per position stream (Qwen2-VL), else None

    def init_rope(self) -> None:
        """cos/sin tables (float32), computed outside any meta-device context."""
        self.cos, self.sin = rope_cos_sin(self.config, self.shape.head_dim, self.max_positions)

    def pack_weights(self) -> None:
        """Lay the linear weights out once for oneDNN where that is exact (bf16 on CPU)."""
        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(layer, name, pack_linear(getattr(layer, name)))
        # A packed copy of the head (tied: the embedding keeps its own table for lookups).
        self.packed_head = packed_if_exact(self.embed.weight if self.lm_head is None else self.lm_head.weight)

    @torch.inference_mode()
    def forward(
        self, fb: ForwardBatch, input_ids: torch.Tensor, kv_pool, attn: TorchAttention
    ) -> torch.Tensor:
        """Logits (in the model's dtype) at each request's last token [bs, vocab],
        followed by those of fb.extra_logit_rows when set."""
        s = self.shape
        h = self.embed(input_ids)
        for feature, _ in fb.features:  # e.g. image embeddings spliced into the prompt
            h = feature.modify_embeddings(fb, h)
        meta = attn.prepare(fb, s.num_q_heads, s.num_kv_heads, s.sliding_window)
        positions, cos, sin = self._rope_inputs(fb)
        delta = None
        for i, layer in enumerate(self.layers):
            h, delta = layer(h, delta, positions, cos, sin, kv_pool.k[i], kv_pool.v[i], meta, attn)
        rows = (
            fb.logits_index
            if fb.extra_logit_rows is None
            else torch.cat([fb.logits_index, fb.extra_logit_rows])
        )
        _, h = add_rms_norm(h[rows], delta[rows], self.norm, s.rms_norm_eps)
        if self.packed_head is not None:
            return self.packed_head(h)
        return F.linear(h, self.embed.weight if self.lm_head is None else self.lm_head.weight)

    def _rope_inputs(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions, cos table, sin table) the layers rotate by. With M-RoPE, when a feature moved
        some tokens' positions (images), per-token tables indexed by the packed row."""
        if self.mrope is None:
            return fb.positions, self.cos, self.sin
        same = fb.positions.unsqueeze(0).expand(3, -1)
        pos3 = same
        for feature, _ in fb.features:
            pos3 = feature.rope_positions(fb, pos3)
        if pos3 is same:  # three equal streams: plain RoPE
            return fb.positions, self.cos, self.sin
        cos, sin = mrope_cos_sin(self.cos, self.sin, pos3, self.mrope)
        return torch.arange(pos3.shape[1], device=pos3.device), cos, sin

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face checkpoint tensors in, fusing qkv and gate/up."""
        s = self.shape

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise KeyError(f"checkpoint lacks {name}")
            return tensors[name]

        with torch.no_grad():
            self.embed.weight.copy_(take("model.embed_tokens.weight"))
            self.norm.copy_(take("model.norm.weight"))
            if self.lm_head is not None:
                self.lm_head.weight.copy_(take("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                a = p + "self_attn."
                layer.qkv.weight.copy_(torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"]))
                if s.qkv_bias:
                    layer.qkv.bias.copy_(torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"]))
                layer.o.weight.copy_(take(a + "o_proj.weight"))
                if s.o_bias:
                    layer.o.bias.copy_(take(a + "o_proj.bias"))
                layer.gate_up.weight.copy_(
                    torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
                )
                layer.down.weight.copy_(take(p + "mlp.down_proj.weight"))
                layer.input_norm.copy_(take(p + "input_layernorm.weight"))
                layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
