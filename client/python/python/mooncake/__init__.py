"""Compatibility namespace: ``from mooncake.store import MooncakeDistributedStore``
works unchanged on top of Mooncake Store (Rust). See ``mooncake.store``."""
