"""The tiny Hugging Face checkpoint the tests build (see ballast.model.demo)."""

from ballast.model.demo import CHAT_TEMPLATE, CORPUS, SEED, make_tiny_llama, train_tokenizer

__all__ = ["CHAT_TEMPLATE", "CORPUS", "SEED", "make_tiny_llama", "train_tokenizer"]
