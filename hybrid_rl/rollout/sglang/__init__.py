"""The SGLang engine (engine.py), its calls on a dedicated thread (calls.py), the weight payloads (CUDA IPC
handles, weight_transport.py), the allocator settings it needs (alloc_conf.py) and LoRA (lora.py). `sglang`
is imported lazily, in engine.py and weight_transport.py only.
"""
