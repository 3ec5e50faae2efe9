"""The LightningDataModules that put sources, tokens and batches together: one for every objective,
one for a mixture, and streaming.
"""
