"""Training built on a Resolution: a real TrainingArguments (training_arguments) and LoRA/QLoRA
adapters (lora_training).

May import: core/ ... resolve/.
"""
