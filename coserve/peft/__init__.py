"""Bypass networks over the frozen base: HF PEFT adapter files and batched multi-adapter application."""

from coserve.peft.lora_adapter import AdapterError, LoraAdapter, load_lora_adapter
from coserve.peft.lora_bank import LoraBank, LoraBatch

__all__ = ["AdapterError", "LoraAdapter", "LoraBank", "LoraBatch", "load_lora_adapter"]
