"""Checkpoints: sharded save and bit-exact resume (sharded.py), and the export to a Hugging Face directory
(export.py; `python -m hybrid_rl.export`).
"""
