"""Fine-tuning any model: parameters frozen by name (`model.freeze`), LoRA adapters through peft
(`model.lora`), frozen layers held in the autocast dtype (`model.frozen_dtype`), and the adapters
merged or saved apart for an export. Applied to the model as built, before any precision mode
converts or wraps it (mpexp/build.py)."""
