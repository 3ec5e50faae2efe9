"""Text to token ids and back to disk: tokenizers, the fast encoder, packing, the token cache,
litdata stores, and prepare().
"""
