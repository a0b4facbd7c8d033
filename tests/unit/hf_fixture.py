"""The tiny Hugging Face checkpoint the tests build (see serve_app.model.demo)."""

from serve_app.model.demo import CHAT_TEMPLATE, CORPUS, SEED, make_tiny_llama, train_tokenizer

__all__ = ["CHAT_TEMPLATE", "CORPUS", "SEED", "make_tiny_llama", "train_tokenizer"]
