"""The native engine: the policy's own module decodes (engine.py), with a static KV cache, the lean
decode step, CUDA graphs, the sampler and the decode loop.
"""
