"""The OpenAI API behind API keys, and the first-token objective's refusal: a real server
with two tiny generative models (one with an objective no request can meet) and an auth
file; the official ``openai`` client."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import yaml

from tests.conftest import RunningServer, start_server
from tests.llm_models import build_llm

TINY_KEY = "tiny-only-key-0123456789"
ADMIN_KEY = "admin-key-0123456789abcdef"
CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("llm-auth-repo")
    build_llm(root, "tiny")
    build_llm(root, "strict", slo={"ttft_p99_ms": 0.001})  # never met: refused at once
    work = tmp_path_factory.mktemp("llm-auth")
    auth = work / "auth.yaml"
    auth.write_text(
        yaml.safe_dump(
            {
                "keys": [
                    {"name": "tiny", "token": TINY_KEY, "models": ["tiny"]},
                    {"name": "admin", "token": ADMIN_KEY, "models": "*", "admin": True},
                ]
            }
        )
    )
    server = start_server(root, work, "--auth-file", str(auth))
    yield server
    server.stop()


def _client(server: RunningServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=key, max_retries=0)


def test_keys_guard_the_models_they_name(secured: RunningServer) -> None:
    tiny = _client(secured, TINY_KEY)
    out = tiny.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert out.choices[0].message.content is not None
    with pytest.raises(openai.PermissionDeniedError) as info:
        tiny.chat.completions.create(model="strict", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert info.value.response.json()["error"]["type"] == "permission_error"
    with pytest.raises(openai.AuthenticationError) as denied:
        _client(secured, "wrong-key-0123456789").models.list()
    assert denied.value.response.json()["error"]["type"] == "authentication_error"
    assert [m.id for m in tiny.models.list().data] == ["tiny"]
    assert [m.id for m in _client(secured, ADMIN_KEY).models.list().data] == ["strict", "tiny"]


def test_first_token_objective_refuses_with_429(secured: RunningServer) -> None:
    admin = _client(secured, ADMIN_KEY)
    with pytest.raises(openai.RateLimitError) as info:
        admin.chat.completions.create(model="strict", messages=CHAT, max_tokens=4)  # type: ignore[arg-type]
    response = info.value.response
    assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1
    error = response.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "ttft_p99_ms" in error["message"]
    with pytest.raises(openai.RateLimitError):  # streamed: refused before the stream starts
        admin.chat.completions.create(model="strict", messages=CHAT, max_tokens=4, stream=True)  # type: ignore[arg-type]
    out = admin.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert out.usage is not None and out.usage.completion_tokens >= 1
