"""The process's runtime: distributed helpers (no-ops on one rank), stop signals, host memory, user imports.

The bottom of the package beside types.py: nothing here imports another folder of hybrid_rl.
"""
