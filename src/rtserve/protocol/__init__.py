"""Open Inference Protocol (KServe V2) types and codecs."""
