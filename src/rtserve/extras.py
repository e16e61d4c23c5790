"""Which pip extra brings a module a model needs, for load errors that say what to install.

A plain ``pip install rtserve`` serves ONNX models; torch, transformers, tokenizers and
Pillow come with extras. A model whose backend (or whose own ``model.py``) imports one that
is missing fails to load with a ``ConfigError`` naming the extra
(``pip install 'rtserve[llm]'``) rather than a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

# Top-level module -> the extra that installs it (backend: llm takes torch from ``llm``).
MODULE_EXTRAS = {
    "torch": "torch",
    "transformers": "llm",
    "gguf": "llm",
    "accelerate": "llm",
    "tokenizers": "pipelines",
    "PIL": "pipelines",
    "ai_edge_litert": "edge",
    "opentelemetry": "tracing",
    "ray": "ray",
}
LLM_MODULES = frozenset({"torch", "transformers", "tokenizers", "safetensors", "jinja2"})


def missing_module(exc: BaseException) -> str | None:
    """The top-level module a ``ModuleNotFoundError`` (or one that caused ``exc``) names."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, ModuleNotFoundError) and exc.name:
            return exc.name.split(".")[0]
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
        seen += 1
    return None


def install_hint(exc: BaseException, backend: str = "") -> str:
    """``"; this install lacks 'torch': pip install 'rtserve[llm]'"`` when ``exc`` is (or
    comes from) a missing module an extra provides; else ``""``."""
    module = missing_module(exc)
    if module is None:
        return ""
    extra = "llm" if backend == "llm" and module in LLM_MODULES else MODULE_EXTRAS.get(module)
    if extra is None:
        return f"; this environment lacks the Python package that provides {module!r}"
    return f"; this install lacks {module!r}: pip install 'rtserve[{extra}]'"
