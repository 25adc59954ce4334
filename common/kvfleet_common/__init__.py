"""The wire contract shared by kvfleet's engine, gateway and operator.

Nothing in this package imports torch: the gateway and operator images must not need it.
"""

__version__ = "0.1.0"
