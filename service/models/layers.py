"""The parts every decoder family is built from, for packed batches.

Hidden states are packed [T, hidden] across the batch's requests; attention reads and writes the
paged KV pool through an attention backend (`backends.py`). A family file (`llama.py`, `qwen3.py`,
`gemma.py`, `phi3.py`, ...) says how its config maps to a `ModelShape` and its checkpoint to these
modules; `families.py` picks the family from config.json's `architectures`.

- norms: RMSNorm weights; Gemma's (1 + w) form is stored as 1 + w at load time, so one kernel
  serves both (`ops.add_rms_norm`);
- `SelfAttention`: the fused qkv projection, optional per-head q/k RMSNorm, rotary (full or
  partial, per-layer tables), the backend call (sliding window, soft-capping, scale per layer);
- `GatedMLP`: fused gate+up (biases where `mlp_bias`), the config's activation (SiLU, GELU, GELU-tanh,
  ReLU), down;
  a mixture-of-experts family's sparse layers take `moe.MoEBlock` instead (`ModelShape.moe`);
- `CausalLM`: embedding (optionally scaled), the layers, final norm, LM head (tied or not),
  final-logit soft-capping.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from service.core.forward_batch import ForwardBatch
from service.models.linear import fast_twin, pack_linear
from service.models.mla import LatentAttention, MLAShape
from service.models.moe import MoEBlock, MoEShape
from service.models.ops import (
    add_rms_norm,
    gelu_mul,
    gelu_tanh_mul,
    layer_norm_qk_heads,
    norm_qk_heads,
    relu2,
    relu2_mul,
    relu_mul,
    scale_by_position,
    silu_mul,
    soft_cap,
    split_qkv_rope,
)
from service.models.recurrent import RecurrentMixer, RecurrentRows
from service.models.rope import DEFAULT_LAYER, mrope_cos_sin, mrope_section, rope_table, rotary_dim

ACTIVATIONS = {
    "silu": silu_mul,
    "gelu": gelu_mul,
    "gelu_tanh": gelu_tanh_mul,
    "relu": relu_mul,
    "relu2": relu2_mul,
}
PLAIN_ACTIVATIONS = {  # the same, without a gate (PlainMLP)
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "relu2": relu2,
}
# transformers' names for them (config `hidden_act`; Gemma-2/3's `hidden_activation`; GPT-2's and
# OPT's `activation_function`)
ACTIVATION_OF_CONFIG = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",  # erf
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",  # the same tanh approximation, spelt out
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
    "relu2": "relu2",  # relu(x) squared (Nemotron, Arcee)
    "xielu": "xielu",  # learned per layer (Apertus; an MLP without a gate only)
}


class UnsupportedModel(ValueError):
    """A model directory this server cannot serve: config.json asks for something no model file
    serves, or the weights are missing or not what its family needs; the message names it."""

    @classmethod
    def because(cls, what: str, error: Exception) -> UnsupportedModel:
        """`what`, then the first line of the library error that refused it."""
        text = str(error).strip()
        return cls(f"{what}: {text.splitlines()[0] if text else type(error).__name__}")


@dataclass(frozen=True)
class LayerAttention:
    """What differs between a model's attention layers: its sliding window, soft-capping, ALiBi."""

    window: int | None = None  # attend to at most this many most recent positions
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)
    alibi: tuple[float, ...] | None = None  # ALiBi: scores + slope_h * kv position, a slope per q head


@dataclass(frozen=True)
class ModelShape:
    """The numbers the engine needs about a model (KV pool sizing, limits) and what its layers do."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    norm_eps: float  # the norms' epsilon (RMSNorm's, or LayerNorm's where `norm` is "layer")
    tie_word_embeddings: bool
    max_position_embeddings: int
    layer_attention: tuple[LayerAttention, ...]  # per layer
    layer_rope: tuple[str, ...]  # per layer: its rope table (a layer type, or DEFAULT_LAYER)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each q and k head before rotary (Qwen3, Gemma-3)
    qk_norm_whole: bool = False  # ... over all of q and all of k instead of per head (OLMo-2)
    qk_norm_after_rope: bool = False  # ... per head after rotary instead (HunYuan, NanoChat)
    # ... a LayerNorm per head instead (mean-centred; weights [heads, head_dim], biases where
    # `qk_norm_bias`): Command R+, StableLM-2-12B, Phi's `qk_layernorm`
    qk_layer_norm: bool = False
    qk_norm_bias: bool = False
    # (beta, period): q times 1 + beta * log(1 + floor(position / period)) after rotary (Ministral 3's
    # `llama_4_scaling_beta` over `original_max_position_embeddings`)
    q_position_scale: tuple[float, int] | None = None
    qkv_clip: float | None = None  # q, k, v clamped to [-clip, clip] after the q/k norms (OLMo)
    attn_sinks: bool = False  # a learned logit per head in each softmax's denominator (gpt-oss)
    activation: str = "silu"
    attn_scale: float | None = None  # None: head_dim ** -0.5
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden))
    embed_norm: bool = False  # the final RMSNorm applied to the embeddings too (NanoChat)
    embed_layer_norm: bool = False  # a LayerNorm of its own on the embeddings (Bloom)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma-2)
    # each block's output (after its sandwich norm, if any) times this before its residual add (Granite)
    residual_scale: float | None = None
    logits_divisor: float | None = None  # logits divided by this (Granite's logits_scaling)
    logits_scale: float | None = None  # logits times this (Cohere's logit_scale)
    sandwich_norms: bool = False  # norms after attention and the MLP too (Gemma-2/3)
    post_norms: bool = False  # norms only after attention and the MLP, none before (OLMo-2)
    post_norm_layers: tuple[bool, ...] = ()  # ... per layer where it differs between them (OLMo hybrid)
    mlp_bias: bool = False  # biases on gate, up and down (Llama's `mlp_bias`), or fc and proj
    # The GPT lineage (GPT-2, GPT-NeoX, OPT, Phi-2, StarCoder2): LayerNorms with biases, plain MLPs,
    # blocks side by side, learned absolute positions.
    norm: str = "rms"  # "rms", or "layer": LayerNorm before each block and at the end
    norm_bias: bool = True  # ... with a bias (Cohere's has none)
    mlp_gated: bool = True  # False: proj(act(fc(x))), no gate (the GPT lineage, Nemotron, Arcee)
    parallel_blocks: bool = False  # attention and MLP both read the layer's input (GPT-NeoX, Phi-2)
    shared_block_norm: bool = False  # ... through one norm (Phi-2); else a norm each
    lm_head_bias: bool = False  # the LM head has a bias (Phi-2)
    learned_positions: int | None = (
        None  # absolute position embeddings at this offset (GPT-2 0, OPT 2); None: rotary
    )
    moe: MoEShape | None = None  # routed experts (Mixtral, Qwen3-MoE) in the layers `moe_layers` marks
    moe_layers: tuple[bool, ...] = ()  # per layer: MoE (True) or the dense GatedMLP
    mla: MLAShape | None = None  # multi-head latent attention (DeepSeek-V2/V3) instead of SelfAttention
    # attention's output times sigmoid(gate(x)) before o, a gate value per q dim (Qwen3-Next, Qwen3.5),
    # or per head with `attn_gate_per_head` (LFM3)
    attn_output_gate: bool = False
    attn_gate_per_head: bool = False
    # a recurrent layer (recurrent.py) instead of attention in the layers `recurrent_layers` marks,
    # with states per request slot, not K/V rows: Gated DeltaNet (Qwen3-Next, Qwen3.5), LFM2's conv
    recurrent: RecurrentMixer | None = None
    recurrent_layers: tuple[bool, ...] = ()
    # per layer, its one block where each layer is one pre-norm block ("attention", "recurrent", "mlp"
    # or "moe": Nemotron-H's `BlockLayer`); () where each layer has attention and an MLP
    layer_blocks: tuple[str, ...] = ()
    # every layer's recurrent layer runs beside its attention on the same normed input, their outputs
    # summed (Falcon-H1); the layer keeps K/V rows and states
    parallel_recurrent: bool = False

    def __post_init__(self) -> None:
        if self.mlp_gated and self.activation not in ACTIVATIONS:
            raise UnsupportedModel(f"{self.architecture}: a gated MLP with {self.activation!r} is not served")
        if self.moe is not None and self.moe.ungated_act is None and self.activation != "silu":
            raise UnsupportedModel(
                f"{self.architecture}: routed experts run SiLU only, the config asks for {self.activation!r}"
            )

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @property
    def kv_layers(self) -> tuple[bool, ...]:
        """Per layer: whether it keeps K/V rows (every layer with attention)."""
        if self.layer_blocks:
            return tuple(b == "attention" for b in self.layer_blocks)
        return tuple(not self.is_recurrent(i) for i in range(self.num_layers))

    def is_recurrent(self, layer: int) -> bool:
        """A recurrent layer in attention's place (`recurrent_layers`, or a BlockLayer's block)."""
        if self.layer_blocks:
            return self.layer_blocks[layer] == "recurrent"
        return bool(self.recurrent_layers) and self.recurrent_layers[layer]

    def state_specs(self, dtype: torch.dtype) -> list:
        """Per layer, the shapes and dtypes of its per-slot states (None: a layer with K/V rows)."""
        assert self.recurrent is None or self.recurrent_layers or self.layer_blocks or self.parallel_recurrent
        return [
            self.recurrent.state_shapes(dtype)  # type: ignore[union-attr]
            if self.is_recurrent(i) or self.parallel_recurrent
            else None
            for i in range(self.num_layers)
        ]


def served_layer_types(config, served: tuple[str, ...]) -> list[str]:
    """config.layer_types, refused naming those a family does not serve."""
    types = list(config.layer_types)
    other = sorted(set(types) - set(served))
    if other:
        raise UnsupportedModel(f"{architecture(config)}: layer types {', '.join(other)} are not served")
    return types


def layer_rope_keys(config, num_layers: int) -> tuple[str, ...]:
    """Per layer, its rope table's key: its layer type where the config gives a rope per type
    (Gemma-3's local and global bases, OLMo-3's), else the model's one rope."""
    params = getattr(config, "rope_parameters", None) or {}
    types = getattr(config, "layer_types", None) or ("full_attention",) * num_layers
    if all(isinstance(params.get(t), dict) for t in set(types)):
        return tuple(types)
    return (DEFAULT_LAYER,) * num_layers


# Language models of vision-language checkpoints that transformers gives no causal LM of its own,
# by their text config's model type: what they are for text (Qwen3-VL's is Qwen3 with M-RoPE, whose
# three position streams are equal on text, and DeepStack, which only adds image features).
TEXT_MODEL_ARCHITECTURES = {
    "qwen3_vl_text": "Qwen3ForCausalLM",
    "qwen3_vl_moe_text": "Qwen3MoeForCausalLM",
    "mistral4": "Mistral4ForCausalLM",  # Mistral Small 4's: transformers has the class, not the entry
}


def architecture(config) -> str:
    """config.json's `architectures[0]`; a config without one (a LLaVA's text config) names its
    model type, whose causal LM transformers knows (or `TEXT_MODEL_ARCHITECTURES` does)."""
    names = getattr(config, "architectures", None)
    if names:
        return names[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", "")
    if model_type in TEXT_MODEL_ARCHITECTURES:
        return TEXT_MODEL_ARCHITECTURES[model_type]
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModel(
            f"config.json names no architecture, and model type {model_type!r} has no causal LM"
        )
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def activation(config) -> str:
    """The MLP's activation (an ACTIVATIONS key) from the config; one not served is refused."""
    name = (
        getattr(config, "hidden_activation", None)
        or getattr(config, "hidden_act", None)
        or getattr(config, "activation_function", None)
        or "silu"
    )
    if name not in ACTIVATION_OF_CONFIG:
        raise UnsupportedModel(
            f"{architecture(config)}: hidden activation {name!r} is not served; "
            f"served: {', '.join(ACTIVATION_OF_CONFIG)}"
        )
    return ACTIVATION_OF_CONFIG[name]


def base_shape(config, **overrides) -> ModelShape:
    """The fields every family reads the same way (transformers' names), then the family's own.
    Per-layer windows follow `layer_types` where the config has them (Qwen2/3's max_window_layers,
    Gemma's alternation), else `sliding_window` applies to every layer (Mistral, Phi-3). A family
    without attention (Mamba's configs name no attention heads) gives the head fields itself."""
    heads = overrides.get("num_q_heads") or config.num_attention_heads
    window = getattr(config, "sliding_window", None) or None
    types = getattr(config, "layer_types", None)
    n = config.num_hidden_layers
    if types is not None:
        windows = tuple(int(window) if t == "sliding_attention" and window else None for t in types)
    else:
        windows = (int(window) if window else None,) * n
    fields = dict(
        architecture=architecture(config),
        num_layers=n,
        hidden_size=config.hidden_size,
        num_q_heads=heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate_size=getattr(config, "intermediate_size", None),
        vocab_size=config.vocab_size,
        norm_eps=getattr(config, "rms_norm_eps", None),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        max_position_embeddings=getattr(config, "max_position_embeddings", 2048),
        layer_attention=tuple(LayerAttention(w) for w in windows),
        layer_rope=(DEFAULT_LAYER,) * n,
        activation=activation(config),
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
    )
    fields.update(overrides)
    return ModelShape(**fields)


def layer_norm_shape(config, norm_eps: float, bias: bool, **overrides) -> ModelShape:
    """base_shape for the GPT lineage: LayerNorm blocks, MLPs without a gate, `bias` on every
    projection (attention's and the MLP's); then the family's own fields."""
    fields = dict(norm="layer", norm_eps=norm_eps, mlp_gated=False, mlp_bias=bias, qkv_bias=bias, o_bias=bias)
    return base_shape(config, **{**fields, **overrides})


class SelfAttention(nn.Module):
    """qkv -> (q/k norm) -> rotary -> paged attention -> o."""

    def __init__(self, s: ModelShape):
        super().__init__()
        self.s = s
        q, kv = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.qkv = nn.Linear(s.hidden_size, q + 2 * kv, bias=s.qkv_bias)
        self.o = nn.Linear(q, s.hidden_size, bias=s.o_bias)
        gates = s.num_q_heads if s.attn_gate_per_head else q
        self.gate = nn.Linear(s.hidden_size, gates, bias=False) if s.attn_output_gate else None
        if s.qk_norm and s.qk_layer_norm:
            self.q_norm = nn.Parameter(torch.ones(s.num_q_heads, s.head_dim))
            self.k_norm = nn.Parameter(torch.ones(s.num_kv_heads, s.head_dim))
            if s.qk_norm_bias:
                self.q_norm_bias = nn.Parameter(torch.zeros(s.num_q_heads, s.head_dim))
                self.k_norm_bias = nn.Parameter(torch.zeros(s.num_kv_heads, s.head_dim))
        elif s.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(q if s.qk_norm_whole else s.head_dim))
            self.k_norm = nn.Parameter(torch.ones(kv if s.qk_norm_whole else s.head_dim))
        self.sinks = nn.Parameter(torch.zeros(s.num_q_heads)) if s.attn_sinks else None

    def forward(self, x, positions, cos, sin, k_cache, v_cache, meta, attn) -> torch.Tensor:
        s = self.s
        hq, hkv, d = s.num_q_heads, s.num_kv_heads, s.head_dim
        qkv = self.qkv(x)
        if s.qk_norm and s.qk_layer_norm:
            q_bias, k_bias = (self.q_norm_bias, self.k_norm_bias) if s.qk_norm_bias else (None, None)
            qkv = layer_norm_qk_heads(
                qkv, hq, hkv, d, (self.q_norm, q_bias), (self.k_norm, k_bias), s.norm_eps
            )
        elif s.qk_norm and not s.qk_norm_after_rope:
            qkv = norm_qk_heads(qkv, hq, hkv, d, self.q_norm, self.k_norm, s.norm_eps)
        if s.qkv_clip is not None:
            qkv = qkv.clamp(-s.qkv_clip, s.qkv_clip)
        q, k, v = split_qkv_rope(qkv, hq, hkv, d, positions, cos, sin)
        if s.qk_norm_after_rope:  # in place: k keeps v's row stride (the kernels store both so)
            q.copy_(add_rms_norm(q.reshape(-1, d), None, self.q_norm, s.norm_eps)[1].view(q.shape))
            k.copy_(add_rms_norm(k.reshape(-1, d), None, self.k_norm, s.norm_eps)[1].view(k.shape))
        if s.q_position_scale is not None:
            q = scale_by_position(q, positions, *s.q_position_scale)
        if self.sinks is not None:
            return self.o(attn.forward(q, k, v, k_cache, v_cache, meta, s.scale, sinks=self.sinks))
        out = attn.forward(q, k, v, k_cache, v_cache, meta, s.scale)
        if self.gate is not None:
            g = torch.sigmoid(self.gate(x))
            out = out * (g.repeat_interleave(s.head_dim, dim=-1) if s.attn_gate_per_head else g)
        return self.o(out)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, s: ModelShape):
        super().__init__()
        self.gate_up = nn.Linear(s.hidden_size, 2 * s.intermediate_size, bias=s.mlp_bias)
        self.down = nn.Linear(s.intermediate_size, s.hidden_size, bias=s.mlp_bias)
        self.act = ACTIVATIONS[s.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate_up(x)))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks (Llama, Qwen, Phi-3); with `sandwich_norms` also a norm
    on each block's output before its residual add and a separate pre-MLP norm (Gemma-2/3); with
    `post_norms` only the norms on the blocks' outputs, the blocks reading the residual (OLMo-2).

    (h, delta) -> the next layer's (h, delta): each residual add is deferred into the next norm
    (h + delta, then RMSNorm, in one pass)."""

    def __init__(self, s: ModelShape, index: int = 0):
        super().__init__()
        self.s = s
        self.attn: nn.Module
        if s.is_recurrent(index):
            self.attn = s.recurrent.build(s.hidden_size)  # type: ignore[union-attr]
        elif s.mla is None:
            self.attn = SelfAttention(s)
        else:
            self.attn = LatentAttention(
                s.mla, s.hidden_size, s.num_q_heads, s.norm_eps, s.scale, s.q_position_scale
            )
        self.beside = s.recurrent.build(s.hidden_size) if s.parallel_recurrent else None  # type: ignore[union-attr]
        self.mlp: nn.Module = (
            MoEBlock(s.moe)
            if s.moe is not None and s.moe_layers[index]
            else GatedMLP(s)
            if s.mlp_gated
            else PlainMLP(s)
        )
        self.post_norms = s.post_norm_layers[index] if s.post_norm_layers else s.post_norms
        if not self.post_norms:
            self.input_norm = nn.Parameter(torch.ones(s.hidden_size))
        self.post_norm = nn.Parameter(
            torch.ones(s.hidden_size)
        )  # after attention (pre-MLP when pre-norm only)
        if s.sandwich_norms:
            self.pre_mlp_norm = nn.Parameter(torch.ones(s.hidden_size))
        if s.sandwich_norms or self.post_norms:
            self.post_mlp_norm = nn.Parameter(torch.ones(s.hidden_size))

    def forward(self, h, delta, positions, cos, sin, k_cache, v_cache, meta, attn, beside=None):
        """`beside`: the states and RecurrentRows of the recurrent layer beside attention (Falcon-H1)."""
        eps = self.s.norm_eps
        if self.post_norms:
            h = h if delta is None else h + delta
            _, a = add_rms_norm(
                self.attn(h, positions, cos, sin, k_cache, v_cache, meta, attn), None, self.post_norm, eps
            )
            h = h + a
            return h, add_rms_norm(self.mlp(h), None, self.post_mlp_norm, eps)[1]
        h, x = add_rms_norm(h, delta, self.input_norm, eps)
        a = self.attn(x, positions, cos, sin, k_cache, v_cache, meta, attn)
        if self.beside is not None:
            states, rows = beside
            a = a + self.beside(x, positions, cos, sin, states, None, rows, attn)
        if not self.s.sandwich_norms:
            scale = self.s.residual_scale
            h, x = add_rms_norm(h, a if scale is None else a * scale, self.post_norm, eps)
            m = self.mlp(x)
            return h, m if scale is None else m * scale
        scale = self.s.residual_scale  # HyperCLOVAX: the normed block outputs times it
        _, a = add_rms_norm(a, None, self.post_norm, eps)
        h, x = add_rms_norm(h, a if scale is None else a * scale, self.pre_mlp_norm, eps)
        m = add_rms_norm(self.mlp(x), None, self.post_mlp_norm, eps)[1]
        return h, m if scale is None else m * scale


class XIELU(nn.Module):
    """xIELU (Apertus): an activation with learned scalars per layer, as transformers computes it:
    x > 0: a_p x^2 + beta x; else (expm1(min(x, eps)) - x) a_n + beta x, where a_p = softplus(alpha_p)
    and a_n = beta + softplus(alpha_n)."""

    def __init__(self):
        super().__init__()
        self.alpha_p = nn.Parameter(torch.zeros(1))
        self.alpha_n = nn.Parameter(torch.zeros(1))
        self.beta = nn.Parameter(torch.zeros(()))
        self.eps = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        negative = (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n
        return torch.where(x > 0, alpha_p * x * x + self.beta * x, negative + self.beta * x)


class PlainMLP(nn.Module):
    """proj(act(fc(x))), biases where `mlp_bias` (the GPT lineage)."""

    def __init__(self, s: ModelShape):
        super().__init__()
        self.fc = nn.Linear(s.hidden_size, s.intermediate_size, bias=s.mlp_bias)
        self.proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=s.mlp_bias)
        self.act: nn.Module | Callable = (
            XIELU() if s.activation == "xielu" else PLAIN_ACTIVATIONS[s.activation]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class LayerNormDecoderLayer(nn.Module):
    """The GPT lineage's block (`norm` "layer"): LayerNorms with biases before attention and the
    MLP, one block after the other (GPT-2, OPT, StarCoder2) or side by side on the layer's input
    (`parallel_blocks`: GPT-NeoX with a norm each, Phi-2 with one norm for both).
    (h, delta) -> the next layer's (h, delta), as DecoderLayer's."""

    def __init__(self, s: ModelShape, index: int = 0):
        super().__init__()
        self.s = s
        self.attn = SelfAttention(s)
        self.mlp: nn.Module = GatedMLP(s) if s.mlp_gated else PlainMLP(s)
        self.input_norm = nn.LayerNorm(s.hidden_size, eps=s.norm_eps, bias=s.norm_bias)
        self.post_norm = (
            None if s.shared_block_norm else nn.LayerNorm(s.hidden_size, eps=s.norm_eps, bias=s.norm_bias)
        )

    def forward(self, h, delta, positions, cos, sin, k_cache, v_cache, meta, attn):
        h = h if delta is None else h + delta
        x = self.input_norm(h)
        a = self.attn(x, positions, cos, sin, k_cache, v_cache, meta, attn)
        if self.s.parallel_blocks:
            return h, a + self.mlp(x if self.post_norm is None else self.post_norm(h))
        h = h + a
        return h, self.mlp(self.post_norm(h))


class BlockLayer(nn.Module):
    """One pre-norm block per layer (Nemotron-H): attention, a recurrent layer or an MLP, as
    `layer_blocks` says. (h, delta) -> the next layer's (h, delta), as DecoderLayer's."""

    def __init__(self, s: ModelShape, index: int = 0):
        super().__init__()
        self.s = s
        kind = s.layer_blocks[index]
        self.attn: nn.Module | None = None
        self.mlp: nn.Module | None = None
        if kind == "attention":
            self.attn = SelfAttention(s)
        elif kind == "recurrent":
            self.attn = s.recurrent.build(s.hidden_size)  # type: ignore[union-attr]
        elif kind == "moe":
            self.mlp = MoEBlock(s.moe)  # type: ignore[arg-type]
        else:
            self.mlp = GatedMLP(s) if s.mlp_gated else PlainMLP(s)
        self.input_norm = nn.Parameter(torch.ones(s.hidden_size))

    def forward(self, h, delta, positions, cos, sin, k_cache, v_cache, meta, attn):
        h, x = add_rms_norm(h, delta, self.input_norm, self.s.norm_eps)
        if self.attn is not None:
            return h, self.attn(x, positions, cos, sin, k_cache, v_cache, meta, attn)
        return h, self.mlp(x)  # type: ignore[misc]


def pack_linears(module: nn.Module) -> None:
    """Replace each nn.Linear below `module` by its packed twin where there is one (service/models/linear.py)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, pack_linear(child))
        else:
            pack_linears(child)


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head over packed tokens."""

    def __init__(self, shape: ModelShape, config, max_positions: int):
        super().__init__()
        self.shape = s = shape
        self.embed = nn.Embedding(s.vocab_size, s.hidden_size)
        self.embed_ln = nn.LayerNorm(s.hidden_size, eps=s.norm_eps) if s.embed_layer_norm else None
        self.pos_embed = (
            None
            if s.learned_positions is None
            else nn.Embedding(s.max_position_embeddings + s.learned_positions, s.hidden_size)
        )
        layer = BlockLayer if s.layer_blocks else DecoderLayer if s.norm == "rms" else LayerNormDecoderLayer
        self.layers = nn.ModuleList(layer(s, i) for i in range(s.num_layers))
        self.norm: nn.Module | nn.Parameter = (
            nn.Parameter(torch.ones(s.hidden_size))
            if s.norm == "rms"
            else nn.LayerNorm(s.hidden_size, eps=s.norm_eps, bias=s.norm_bias)
        )
        self.lm_head = (
            None if s.tie_word_embeddings else nn.Linear(s.hidden_size, s.vocab_size, bias=s.lm_head_bias)
        )
        self.config = config
        self.max_positions = max_positions
        self.rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # init_rope(): per table key
        self.mrope = mrope_section(config)  # M-RoPE bands per position stream (Qwen2-VL), else None
        self.packed_head: nn.Module | None = None  # pack_weights(): the LM head laid out for the fast kernels

    def init_rope(self, device: torch.device | str = "cpu") -> None:
        """cos/sin tables (float32) per rope key, computed outside any meta-device context."""
        for key in set(self.shape.layer_rope):
            layer_type = None if key == DEFAULT_LAYER else key
            cos, sin = rope_table(self.config, self.shape.head_dim, self.max_positions, layer_type)
            self.rope[key] = (cos.to(device), sin.to(device))

    def pack_weights(self) -> None:
        """Lay the linear weights out once for the fastest kernels this CPU has (service/models/linear.py)."""
        pack_linears(self.layers)
        # A packed copy of the head (tied: the embedding keeps its own table for lookups).
        head = self.lm_head
        self.packed_head = fast_twin(self.embed.weight) if head is None else fast_twin(head.weight, head.bias)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, input_ids: torch.Tensor, kv_pool, attn) -> torch.Tensor:
        """Logits (in the model's dtype) at each request's last token [bs, vocab],
        followed by those of fb.extra_logit_rows when set."""
        s = self.shape
        h = self.embed(input_ids)
        if self.embed_ln is not None:
            h = self.embed_ln(h)
        if s.embed_scale is not None:
            h = h * torch.tensor(s.embed_scale, dtype=h.dtype)
        if self.pos_embed is not None:
            h = h + self.pos_embed(fb.positions + s.learned_positions)
        for feature, _ in fb.features:  # e.g. image embeddings spliced into the prompt
            h = feature.modify_embeddings(fb, h)
        if s.embed_norm:
            h = add_rms_norm(h, None, self.norm, s.norm_eps)[1]
        metas = {
            la: attn.prepare(fb, s.num_q_heads, s.num_kv_heads, la.window, la.softcap, la.alibi, s.head_dim)
            for la in dict.fromkeys(s.layer_attention)
        }
        positions, pos3 = fb.positions, self._mrope_positions(fb)
        if pos3 is not None:  # per-token tables, indexed by the packed row
            positions = torch.arange(pos3.shape[1], device=pos3.device)
        tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        delta = None
        recurrent = RecurrentRows.of(fb) if s.recurrent is not None else None
        for i, layer in enumerate(self.layers):
            if s.is_recurrent(i):  # its slot states where other layers take their K/V and metadata
                h, delta = layer(
                    h, delta, positions, None, None, kv_pool.states.layers[i], None, recurrent, attn
                )
                continue
            key = s.layer_rope[i]
            if key not in tables:
                cos, sin = self.rope[key]
                tables[key] = (cos, sin) if pos3 is None else mrope_cos_sin(cos, sin, pos3, self.mrope)
            cos, sin = tables[key]
            meta = metas[s.layer_attention[i]]
            if s.parallel_recurrent:
                beside = (kv_pool.states.layers[i], recurrent)
                h, delta = layer(
                    h, delta, positions, cos, sin, kv_pool.k[i], kv_pool.v[i], meta, attn, beside
                )
                continue
            h, delta = layer(h, delta, positions, cos, sin, kv_pool.k[i], kv_pool.v[i], meta, attn)
        rows = (
            fb.logits_index
            if fb.extra_logit_rows is None
            else torch.cat([fb.logits_index, fb.extra_logit_rows])
        )
        if s.norm == "rms":
            _, h = add_rms_norm(h[rows], delta[rows], self.norm, s.norm_eps)
        else:
            h = self.norm(h[rows] + delta[rows])
        if self.packed_head is not None:
            logits = self.packed_head(h)
        elif self.lm_head is not None:
            logits = self.lm_head(h)
        else:
            logits = F.linear(h, self.embed.weight)
        if s.logits_divisor is not None:
            logits = logits / s.logits_divisor
        if s.logits_scale is not None:
            logits = logits * s.logits_scale
        return soft_cap(logits, s.final_softcap)

    def _mrope_positions(self, fb: ForwardBatch) -> torch.Tensor | None:
        """M-RoPE: the (time, height, width) positions [3, T] when a feature moved some tokens' (images);
        None for plain RoPE (three equal streams)."""
        if self.mrope is None:
            return None
        same = fb.positions.unsqueeze(0).expand(3, -1)
        pos3 = same
        for feature, _ in fb.features:
            pos3 = feature.rope_positions(fb, pos3)
        return None if pos3 is same else pos3


class Checkpoint:
    """A checkpoint's tensors by name; a missing one is named in the error."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise KeyError(f"checkpoint lacks {name}")
        return self.tensors[name]

    def has(self, name: str) -> bool:
        return name in self.tensors

    def cat(self, *names: str) -> torch.Tensor:
        return torch.cat([self(n) for n in names])

    def renamed(self, prefix: str, to: str) -> Checkpoint:
        """The same tensors with names under `prefix` moved under `to` (Mamba's `backbone.` -> `model.`)."""
        n = len(prefix)
        return Checkpoint({to + k[n:] if k.startswith(prefix) else k: v for k, v in self.tensors.items()})

    def first(self, *names: str) -> torch.Tensor:
        """The first of `names` the checkpoint has (a tensor published under different names)."""
        for n in names:
            if n in self.tensors:
                return self.tensors[n]
        raise KeyError(f"checkpoint lacks {' or '.join(names)}")


def load_layer_norm(norm: nn.LayerNorm, take: Checkpoint, name: str) -> None:
    """A LayerNorm's weight and bias (where it has one), `{name}.weight` and `{name}.bias`."""
    norm.weight.copy_(take(name + ".weight"))
    if norm.bias is not None:
        norm.bias.copy_(take(name + ".bias"))


def load_linear(linear: nn.Module, take: Checkpoint, name: str) -> None:
    """A linear's weight (and bias, where it has one), `{name}.weight` and `{name}.bias`."""
    linear.weight.copy_(take(name + ".weight"))
    if linear.bias is not None:
        linear.bias.copy_(take(name + ".bias"))


def load_common(
    model: CausalLM,
    take: Checkpoint,
    norm_offset: float = 0.0,
    embed: str = "model.embed_tokens",
    norm: str = "model.norm",
) -> None:
    """Embedding, final norm (RMSNorm or LayerNorm) and (untied) LM head under transformers'
    names (a family's own: `embed`, `norm`). norm_offset 1: Gemma's (1 + w) norms, stored as 1 + w."""
    model.embed.weight.copy_(take(embed + ".weight"))
    if isinstance(model.norm, nn.LayerNorm):
        load_layer_norm(model.norm, take, norm)
    else:
        model.norm.copy_(take(norm + ".weight") + norm_offset)
    if model.lm_head is not None:
        model.lm_head.weight.copy_(take("lm_head.weight"))


def load_split_projections(layer: DecoderLayer, take: Checkpoint, p: str) -> None:
    """q/k/v and gate/up published as separate projections (Llama's layout), fused here; an MLP
    without a gate (Nemotron's, Arcee's) from `up_proj` and `down_proj`."""
    load_split_attention(layer, take, p)
    load_split_mlp(layer, take, p)


def load_split_mlp(layer: DecoderLayer, take: Checkpoint, p: str) -> None:
    """gate/up (fused here) and down under `{p}mlp.`, or an MLP without a gate's up and down."""
    mlp = layer.mlp
    if isinstance(mlp, PlainMLP):
        load_linear(mlp.fc, take, p + "mlp.up_proj")
        load_linear(mlp.proj, take, p + "mlp.down_proj")
        return
    mlp.gate_up.weight.copy_(take.cat(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"))
    mlp.down.weight.copy_(take(p + "mlp.down_proj.weight"))
    if mlp.gate_up.bias is not None:
        mlp.gate_up.bias.copy_(take.cat(p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"))
        mlp.down.bias.copy_(take(p + "mlp.down_proj.bias"))


@torch.no_grad()
def rotate_pairs_as_halves(model: CausalLM) -> None:
    """Interleaved rotary (GPT-J's, GLM's, ERNIE's: dims 2i and 2i+1 turn together) served by the
    rotate-half kernels: each q and k head's rows of the fused projection (and biases) are
    reordered, the rotary dims' evens, then their odds, then the dims that do not turn. Scores are
    unchanged (q and k reordered alike); v and o are not touched. Call after loading."""
    s = model.shape
    d = s.head_dim
    r = rotary_dim(model.config, d)
    order = torch.cat([torch.arange(0, r, 2), torch.arange(1, r, 2), torch.arange(r, d)])
    rows = (torch.arange(s.num_q_heads + s.num_kv_heads).unsqueeze(1) * d + order).flatten()
    for layer in model.layers:
        attn = layer.attn
        for p in (attn.qkv.weight, attn.qkv.bias):
            if p is not None:
                p[: rows.numel()] = p[rows]
        if s.qk_norm and not s.qk_norm_whole:  # per-head norms' weights (and biases) along a head
            for p in (
                attn.q_norm,
                attn.k_norm,
                getattr(attn, "q_norm_bias", None),
                getattr(attn, "k_norm_bias", None),
            ):
                if p is not None:
                    p.copy_(p[..., order])


def load_split_attention(layer: DecoderLayer, take: Checkpoint, p: str) -> None:
    """q/k/v (and o) published as separate projections, fused here."""
    a = p + "self_attn."
    attn = layer.attn
    attn.qkv.weight.copy_(take.cat(*(a + f"{n}_proj.weight" for n in "qkv")))
    if attn.qkv.bias is not None:
        attn.qkv.bias.copy_(take.cat(*(a + f"{n}_proj.bias" for n in "qkv")))
    attn.o.weight.copy_(take(a + "o_proj.weight"))
    if attn.o.bias is not None:
        attn.o.bias.copy_(take(a + "o_proj.bias"))
