"""rtserve: a real-time ML inference server and model-optimization toolkit."""

__version__ = "0.1.0"
