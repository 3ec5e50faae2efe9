"""Token arrays to batches: collators (masking, shifting, span corruption, prefix LM), samplers,
warmups and a mixture's task draws.
"""
