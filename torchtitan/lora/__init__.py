"""Parameter-efficient fine-tuning: LoRA / QLoRA adapters on a frozen base, and their PEFT
format (docs/lora.md)."""
