"""Bypass networks over the frozen base: HF PEFT adapter files and batched multi-adapter application."""

from coserve.peft.adapter_dir import AdapterError
from coserve.peft.ia3_adapter import IA3Adapter, load_ia3_adapter
from coserve.peft.ia3_bank import IA3Bank, IA3Batch
from coserve.peft.lora_adapter import LoraAdapter, load_lora_adapter
from coserve.peft.lora_bank import LoraBank, LoraBatch
from coserve.peft.served_adapters import AdapterSlots, MixedAdapterBatch, ServedAdapter, load_peft_adapter

__all__ = ["AdapterError", "AdapterSlots", "IA3Adapter", "IA3Bank", "IA3Batch", "LoraAdapter", "LoraBank",
           "LoraBatch", "MixedAdapterBatch", "ServedAdapter", "load_ia3_adapter", "load_lora_adapter",
           "load_peft_adapter"]
