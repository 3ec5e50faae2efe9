"""transformers interop: model directories in and out of the core, and the per-family config and
tensor maps.
"""
