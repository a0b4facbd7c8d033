"""The tiny Hugging Face checkpoint the tests build (see ballast.model.demo), and LoRA
adapters for it (``make_lora_adapter``, with peft)."""

from __future__ import annotations

from pathlib import Path

from ballast.model.demo import CHAT_TEMPLATE, CORPUS, SEED, make_tiny_llama, train_tokenizer

__all__ = ["CHAT_TEMPLATE", "CORPUS", "SEED", "LORA_TARGETS", "make_lora_adapter", "make_tiny_llama", "train_tokenizer"]

# The Llama projections an adapter changes (every one vLLM's LoRA layers take).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapter(base_dir: Path, out_dir: Path, seed: int, r: int = 8) -> Path:
    """Write a random LoRA adapter of rank ``r`` for the Llama in ``base_dir`` into
    ``out_dir`` (PEFT's ``adapter_config.json`` and ``adapter_model.safetensors``); return
    ``out_dir``. ``init_lora_weights=False`` draws both matrices at random (PEFT's default
    zeroes B, which changes nothing), so each ``seed`` gives its own output."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype="float32")
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=2 * r, init_lora_weights=False, target_modules=list(LORA_TARGETS))
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(str(out_dir))
    return Path(out_dir)
