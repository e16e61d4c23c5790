"""Generative models (``backend: llm``): continuous batching over a paged KV pool.

``params`` (what a request asks), ``kv`` (the block pool), ``scheduler`` (which tokens run
next), ``runner`` (the model and the packed forward), ``engine`` (the step loop and
``generate``), ``version`` (the model version the server loads).
"""
