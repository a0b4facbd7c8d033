"""The tiny Hugging Face checkpoint the tests build, and LoRA adapters for it (both in
ballast.model.demo)."""

from __future__ import annotations

from ballast.model.demo import (
    CHAT_TEMPLATE,
    CORPUS,
    LORA_TARGETS,
    SEED,
    make_lora_adapter,
    make_tiny_llama,
    train_tokenizer,
)

__all__ = ["CHAT_TEMPLATE", "CORPUS", "SEED", "LORA_TARGETS", "make_lora_adapter", "make_tiny_llama", "train_tokenizer"]
