"""Decoding: sampling parameters and samplers, incremental text, constrained (JSON) output.

The lowest engine room: it knows tokens and logits, nothing of caches or schemas.
"""
