"""The vLLM engine, in the trainer's own processes (engine.py); its start-up arguments and KV sizing
(setup.py); adapter-only LoRA sync (lora.py). `vllm` is imported lazily.
"""
