"""Structured outputs: grammar-constrained decoding (JSON schema, regex, choice, Lark grammar).

``params`` (what a request asks), ``backend`` (llguidance: compile and validate), ``manager`` (the
engine core's compile queue, cache and per-step bitmasks), ``bitmask`` (masking the logits).
"""
