"""Tiny random targets of many architecture families that transformers ships, for the exactness matrix.

Each family is a config class, a CausalLM class and the settings that make it the variant named:
sliding windows (alternating with full layers or not), chunked attention, logit soft-capping and
scaling, MoE, ALiBi, tied and untied embeddings, rope-scaling variants, multi-query attention,
parallel attention + MLP blocks, learned positions, latent attention. Every model is tiny (2-4 layers
of width 32) and its windows are short (8 tokens), so prompts of a dozen tokens cross them. No hub,
no files: tokenizers come from tests/helpers/tiny.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import transformers

from eyas.models import Target
from tests.helpers.tiny import tiny_tokenizer

VOCAB = 320
WINDOW = 8  # every sliding window / attention chunk in the matrix
LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False)
TOKENS = dict(pad_token_id=1, bos_token_id=2, eos_token_id=3)
ALTERNATING = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
# a one-layer vision tower for the multimodal families (their image tokens lie outside the text vocabulary)
SIGLIP = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)


@dataclass(frozen=True)
class Family:
    config: str  # transformers config class
    model: str  # its CausalLM class
    settings: dict = field(default_factory=dict)
    llama_like: bool = True  # start from LLAMA_LIKE (configs that name their sizes so)
    # weights' init std: larger than transformers' 0.02, so that outputs depend on the context (at 0.02 many tiny
    # models, tied ones above all, repeat the last token whatever came before, and would test no attention mask)
    init: float = 0.2
    head: str = "eagle3"  # the head type its tests draft with (eagle1 where layer inputs are not [B, T, H])
    # Target.verify_mode(): "chain" where a tree cannot be verified in one forward (positions from the mask: ALiBi;
    # windows by cache column: GPT-Neo), "tree" everywhere else
    verify: str = "tree"
    text: str | None = None  # a multimodal model: the family of its text decoder (its config's text_config)
    # what its CausalLM does to the logits after the lm_head (the sampling test runs on these), or None
    post_processing: str | None = None


def _falcon(init: float = 0.2, verify: str = "tree", **kw) -> Family:
    return Family("FalconConfig", "FalconForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                              num_attention_heads=4, **kw), llama_like=False, init=init,
                  verify=verify)


FAMILIES: dict[str, Family] = {
    "llama": Family("LlamaConfig", "LlamaForCausalLM"),
    "llama-tied": Family("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama-rope-llama3": Family("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "llama-rope-linear": Family("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=dict(
        rope_type="linear", rope_theta=10000.0, factor=4.0))),
    "llama-rope-yarn": Family("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64))),
    "llama-rope-dynamic": Family("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=dict(
        rope_type="dynamic", rope_theta=10000.0, factor=2.0))),  # exact up to its original length (check_length)
    "llama-mqa": Family("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=1)),
    "qwen2-swa": Family("Qwen2Config", "Qwen2ForCausalLM", dict(  # layers >= max_window_layers slide
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, num_hidden_layers=3)),
    "qwen3": Family("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3-moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)),
    "qwen2-moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(  # routed experts + a shared expert
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    "olmoe": Family("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, clip_qkv=3.0)),
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mistral-swa": Family("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "ministral": Family("MinistralConfig", "MinistralForCausalLM", dict(  # sliding + full, by layer_types
        sliding_window=WINDOW, layer_types=ALTERNATING[:2])),
    "phi3": Family("Phi3Config", "Phi3ForCausalLM"),
    "phi3-longrope": Family("Phi3Config", "Phi3ForCausalLM", dict(
        original_max_position_embeddings=128, rope_parameters=dict(
            rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.1, 1.2, 1.3],
            long_factor=[2.0, 3.0, 4.0, 5.0], original_max_position_embeddings=128))),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM"),
    "gpt-neox": Family("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(  # parallel attention + MLP, partial rotary
        num_key_value_heads=4, use_parallel_residual=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
    "stablelm": Family("StableLmConfig", "StableLmForCausalLM", dict(num_key_value_heads=4, use_qkv_bias=True)),
    "smollm3": Family("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_hidden_layers=4, no_rope_layer_interval=2)),
    "gemma": Family("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": Family("Gemma2Config", "Gemma2ForCausalLM", dict(
        sliding_window=WINDOW, layer_types=ALTERNATING[:2], final_logit_softcapping=1.0, attn_logit_softcapping=5.0,
        query_pre_attn_scalar=8), post_processing="final_logit_softcapping"),
    "gemma3": Family("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        sliding_window=WINDOW, layer_types=ALTERNATING[:2], final_logit_softcapping=1.0, query_pre_attn_scalar=8),
        post_processing="final_logit_softcapping"),
    "gemma3n": Family("Gemma3nTextConfig", "Gemma3nForCausalLM", dict(  # KV shared across layers, AltUp, LAuReL
        num_hidden_layers=4, layer_types=ALTERNATING, sliding_window=WINDOW, num_kv_shared_layers=2,
        vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, laurel_rank=4, altup_num_inputs=2,
        activation_sparsity_pattern=[0.0] * 4, final_logit_softcapping=1.0), post_processing="final_logit_softcapping",
        head="eagle1"),
    "nanochat": Family("NanoChatConfig", "NanoChatForCausalLM", dict(final_logit_softcapping=1.0),
                       post_processing="final_logit_softcapping"),
    "vaultgemma": Family("VaultGemmaConfig", "VaultGemmaForCausalLM", dict(
        sliding_window=WINDOW, layer_types=ALTERNATING[:2], final_logit_softcapping=1.0, query_pre_attn_scalar=8),
        post_processing="final_logit_softcapping"),
    "granite": Family("GraniteConfig", "GraniteForCausalLM", dict(
        logits_scaling=0.25, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2),
        post_processing="logits_scaling"),
    "granitemoe": Family("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(
        num_local_experts=4, num_experts_per_tok=2, logits_scaling=0.25), post_processing="logits_scaling"),
    "cohere": Family("CohereConfig", "CohereForCausalLM", dict(logit_scale=4.0, use_qk_norm=True),
                     post_processing="logit_scale"),
    "cohere2": Family("Cohere2Config", "Cohere2ForCausalLM", dict(
        logit_scale=4.0, sliding_window=WINDOW, layer_types=ALTERNATING[:2]), post_processing="logit_scale"),
    "minicpm3": Family("MiniCPM3Config", "MiniCPM3ForCausalLM", dict(  # latent attention; hidden / logits_scaling
        num_key_value_heads=4, kv_lora_rank=8, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        scale_emb=2.0,
        dim_model_base=8), post_processing="hidden / (hidden_size / dim_model_base)"),
    "deepseek-v3": Family("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(  # latent attention, MoE
        num_key_value_heads=4, kv_lora_rank=8, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1)),
    "exaone4": Family("Exaone4Config", "Exaone4ForCausalLM", dict(
        sliding_window=WINDOW, layer_types=ALTERNATING[:2])),
    "gpt-oss": Family("GptOssConfig", "GptOssForCausalLM", dict(  # attention sinks, sliding + full, MoE
        sliding_window=WINDOW, layer_types=ALTERNATING[:2], num_local_experts=4, num_experts_per_tok=2)),
    "llama4-chunked": Family("Llama4TextConfig", "Llama4ForCausalLM", dict(  # chunked + NoPE layers, MoE
        attention_chunk_size=WINDOW, intermediate_size_mlp=64, num_local_experts=2, num_experts_per_tok=1,
        interleave_moe_layer_step=2, num_hidden_layers=4, no_rope_layer_interval=2)),
    # multimodal CausalLMs (what AutoModelForCausalLM loads for Gemma 3 4B+, Mistral 3, Qwen2.5-VL), text prompts
    "gemma3-vlm": Family("Gemma3Config", "Gemma3ForConditionalGeneration", dict(
        vision_config=SIGLIP, mm_tokens_per_image=4, image_token_index=400, boi_token_index=401, eoi_token_index=402),
        text="gemma3", llama_like=False),  # its forward applies no soft-capping, whatever text_config says
    "mistral3-vlm": Family("Mistral3Config", "Mistral3ForConditionalGeneration", dict(
        vision_config=dict(SIGLIP, head_dim=8), image_token_index=400), text="mistral-swa", llama_like=False),
    "qwen2.5-vl": Family("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration", dict(  # multimodal rope sections
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=400, video_token_id=401, vision_start_token_id=402), text="qwen2-swa", llama_like=False),
    "starcoder2": Family("Starcoder2Config", "Starcoder2ForCausalLM", dict(sliding_window=WINDOW, use_bias=True)),
    "persimmon": Family("PersimmonConfig", "PersimmonForCausalLM", dict(num_key_value_heads=4)),  # qk layernorm
    "codegen": Family("CodeGenConfig", "CodeGenForCausalLM", dict(  # fused qkv, partial rotary, parallel blocks
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=256, n_ctx=256), llama_like=False),
    "phi": Family("PhiConfig", "PhiForCausalLM", dict(  # parallel attention + MLP, partial rotary, dense bias
        num_key_value_heads=4, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                   partial_rotary_factor=0.5)), init=0.5),
    "falcon-mqa": _falcon(multi_query=True, parallel_attn=True),
    "falcon-new-arch": _falcon(new_decoder_architecture=True, num_kv_heads=2, init=0.5),
    "falcon-alibi": _falcon(alibi=True, multi_query=True, verify="chain"),
    "gpt2": Family("GPT2Config", "GPT2LMHeadModel", dict(  # learned positions
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256), llama_like=False, init=0.5),
    "gptj": Family("GPTJConfig", "GPTJForCausalLM", dict(  # parallel attention + MLP, partial rotary
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=256), llama_like=False),
    "gpt-bigcode-mqa": Family("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, multi_query=True), llama_like=False),
    "opt": Family("OPTConfig", "OPTForCausalLM", dict(  # learned positions with an offset
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64,
        word_embed_proj_dim=32, max_position_embeddings=256), llama_like=False, init=0.5),
    "bloom": Family("BloomConfig", "BloomForCausalLM", dict(  # ALiBi
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4), llama_like=False, init=0.5, verify="chain"),
    "mpt": Family("MptConfig", "MptForCausalLM", dict(  # ALiBi
        vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, max_seq_len=256, attn_config=dict(alibi=True)),
        llama_like=False, verify="chain"),
    "gpt-neo-local": Family("GPTNeoConfig", "GPTNeoForCausalLM", dict(  # local attention under its own name
        vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
        attention_types=[[["global", "local"], 1]], window_size=WINDOW, max_position_embeddings=256),
        llama_like=False, verify="chain"),
}

# families whose CausalLM post-processes its logits
POST_PROCESSING = [name for name, f in FAMILIES.items() if f.post_processing]


def family_config(name: str, **overrides) -> transformers.PretrainedConfig:
    f = FAMILIES[name]
    config_cls = getattr(transformers, f.config)
    if f.text is not None:
        text = family_config(f.text, **overrides)
        if f.text == "qwen2-swa":  # Qwen2.5-VL's text rope is split in sections over (time, height, width)
            text.rope_parameters = dict(text.rope_parameters, mrope_section=[1, 1, 2])
        return config_cls(text_config=text.to_dict(), **TOKENS, initializer_range=f.init,
                          tie_word_embeddings=text.tie_word_embeddings, **f.settings)
    init = "init_std" if hasattr(config_cls, "init_std") else "initializer_range"
    return config_cls(**{**(LLAMA_LIKE if f.llama_like else {}), **TOKENS, init: f.init, **f.settings, **overrides})


def family_model(name: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A freshly initialised fp32 model of family `name` (config `overrides` on top; eos disabled in its generation
    config, so that `generate` runs to max_new_tokens)."""
    config = family_config(name, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[name].model)(config).float().eval()
    model.generation_config.eos_token_id = None
    return model


def family_target(name: str, seed: int = 0, **overrides) -> Target:
    vocab = overrides.get("vocab_size", VOCAB)
    return Target(family_model(name, seed, **overrides), tiny_tokenizer(vocab), f"tiny-{name}")
