"""Speculative decoding: draft proposers and the bookkeeping the scheduler keeps of them."""
