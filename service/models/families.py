"""Which model file serves which architecture (config.json's `architectures[0]`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from service.models import (
    apertus,
    bamba,
    bloom,
    cohere,
    deepseek,
    ernie4_5,
    ernie4_5_moe,
    exaone4,
    falcon,
    falcon_h1,
    gemma,
    glm,
    glm4_moe,
    gpt2,
    gpt_bigcode,
    gpt_neo,
    gpt_neox,
    gpt_oss,
    gptj,
    granite,
    granite_moe,
    helium,
    hunyuan,
    hy_v3,
    hyperclovax,
    jais2,
    jamba,
    lfm2,
    llama,
    mamba2_lm,
    minicpm3,
    minimax_m2,
    mixtral,
    mpt,
    nanochat,
    nemotron,
    nemotron_h,
    olmo,
    olmo2,
    olmo_hybrid,
    olmoe,
    opt,
    persimmon,
    phi,
    phi3,
    qwen2_moe,
    qwen3,
    qwen3_5,
    qwen3_moe,
    smollm3,
    stablelm,
    starcoder2,
)
from service.models.layers import CausalLM, Checkpoint, ModelShape, UnsupportedModel, architecture


@dataclass(frozen=True)
class Family:
    shape: Callable[[object], ModelShape]  # config -> shape
    load: Callable[[CausalLM, Checkpoint], None]  # checkpoint tensors into the model (no grad)


FAMILIES: dict[str, Family] = {
    arch: Family(module.shape, module.load)
    for module in (
        llama,
        smollm3,
        granite,
        hyperclovax,
        minicpm3,
        helium,
        qwen3,
        apertus,
        hunyuan,
        nanochat,
        gemma,
        phi3,
        olmo,
        olmo2,
        exaone4,
        glm,
        ernie4_5,
        gpt_neox,
        gptj,
        phi,
        persimmon,
        starcoder2,
        stablelm,
        nemotron,
        jais2,
        cohere,
        gpt2,
        gpt_bigcode,
        gpt_neo,
        falcon,
        bloom,
        mpt,
        opt,
        mixtral,
        qwen2_moe,
        qwen3_moe,
        granite_moe,
        olmoe,
        glm4_moe,
        minimax_m2,
        hy_v3,
        gpt_oss,
        ernie4_5_moe,
        deepseek,
        qwen3_5,
        lfm2,
        bamba,
        nemotron_h,
        falcon_h1,
        mamba2_lm,
        olmo_hybrid,
        jamba,
    )
    for arch in module.ARCHITECTURES
}


class UnsupportedArchitecture(UnsupportedModel):
    """config.json names an architecture no model file serves."""

    def __init__(self, arch: str):
        super().__init__(f"unsupported architecture {arch!r}; supported: {', '.join(FAMILIES)}")
        self.architecture = arch


def family_of(arch: str) -> Family:
    if arch not in FAMILIES:
        raise UnsupportedArchitecture(arch)
    return FAMILIES[arch]


def refuse_quantized(config) -> None:
    """UnsupportedModel naming the method where a config (a model's, or a vision-language model's
    top level) says its weights are quantized."""
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = (
            quant.get("quant_method", "?") if isinstance(quant, dict) else getattr(quant, "quant_method", "?")
        )
        arch = (getattr(config, "architectures", None) or [getattr(config, "model_type", "?")])[0]
        raise UnsupportedModel(
            f"{arch}: quantized weights ({method}) are not served; use the unquantized checkpoint"
        )


def model_shape(config) -> ModelShape:
    """The shape of a (text) config's model; UnsupportedArchitecture names the ones served, and a
    quantized checkpoint is refused naming its method."""
    refuse_quantized(config)
    return family_of(architecture(config)).shape(config)
