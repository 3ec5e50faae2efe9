"""Where text comes from: local files, hub datasets, the embedded standard-library corpus, and
which examples each split holds.
"""
