"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3) driven by a Hugging Face config.json."""
from service.model.config import ModelConfig
from service.model.llama import LlamaForCausalLM

__all__ = ["ModelConfig", "LlamaForCausalLM"]
