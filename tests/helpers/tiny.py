"""Tiny random targets built in-process: several architectures, tied and untied embeddings.

No hub, no files: a config, a seeded random init, and a small word-level tokenizer with a
ChatML template so the data layer can render conversations.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from eyas.models import Target

ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}
# (arch, tied) pairs every architecture-wide test runs over.
FIXTURES = [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", False), ("mistral", False)]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
WORDS = [f"w{i}" for i in range(250)] + ["user", "assistant", "system", "\n", "hello", "world", "the", "a", "."]


def tiny_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    for i in range(len(vocab), vocab_size):
        vocab[f"x{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<|im_end|>", bos_token="<|im_start|>")
    fast.chat_template = CHATML
    return fast


def tiny_model(arch: str = "llama", tied: bool = False, seed: int = 0, num_layers: int = 4,
               vocab_size: int = 320, dtype: torch.dtype = torch.float32):
    config_cls, model_cls = ARCHS[arch]
    config = config_cls(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                        tie_word_embeddings=tied, pad_token_id=1, eos_token_id=3, bos_token_id=2)
    if arch == "mistral":
        config.sliding_window = None
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)
    model.eval()
    return model


def tiny_target(arch: str = "llama", tied: bool = False, seed: int = 0, **kw) -> Target:
    return Target(tiny_model(arch, tied, seed, **kw), tiny_tokenizer(kw.get("vocab_size", 320)), f"tiny-{arch}")
