"""Interoperability: Flax's attention_fn adapter and Hugging Face config readers."""
