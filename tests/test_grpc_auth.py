"""gRPC credentials read as HTTP reads them: lowercase ``authorization`` or ``x-api-key``
metadata, with or without ``Bearer``, ``authorization`` first (the docs' example)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import RunningServer, start_server
from tests.test_security import USER, repo, x_input

# (headers, answered) for both protocols alike.
CASES = [
    ({"authorization": f"Bearer {USER}"}, True),
    ({"authorization": USER}, True),
    ({"x-api-key": USER}, True),
    ({"x-api-key": f"Bearer {USER}"}, True),
    ({"authorization": f"Bearer {USER}", "x-api-key": "wrong-token-0123456789"}, True),
    ({"x-api-key": f"Bearer {USER}", "authorization": "Bearer wrong-token-0123456789"}, False),
    ({"authorization": "Bearer wrong-token-0123456789"}, False),
]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("auth")
    (root / "a.yaml").write_text(f"keys:\n  - {{name: app, token: {USER}, models: [a]}}\n")
    s = start_server(repo(root / "repo"), root / "s", "--auth-file", str(root / "a.yaml"))
    yield s
    s.stop()


def answered(module: object, client: object, headers: dict[str, str]) -> bool:
    try:
        result = client.infer("a", [x_input(module)], headers=headers)  # type: ignore[attr-defined]
    except InferenceServerException as exc:
        assert "credentials" in str(exc.message())
        return False
    assert result.as_numpy("y").tolist() == [[2.0] * 4]
    return True


@pytest.mark.parametrize(("headers", "ok"), CASES)
def test_grpc_and_http_accept_the_same_credentials(secured, headers, ok) -> None:  # type: ignore[no-untyped-def]
    g = grpcclient.InferenceServerClient(secured.grpc)
    h = httpclient.InferenceServerClient(secured.http)
    assert answered(grpcclient, g, headers) is ok
    assert answered(httpclient, h, headers) is ok


def test_capitalised_metadata_is_refused_by_grpcio_itself(secured) -> None:  # type: ignore[no-untyped-def]
    """Why the docs show lowercase ``authorization`` for gRPC: grpcio refuses other keys
    before sending anything."""
    g = grpcclient.InferenceServerClient(secured.grpc)
    with pytest.raises(Exception, match="(?i)metadata"):
        g.infer("a", [x_input(grpcclient)], headers={"Authorization": f"Bearer {USER}"})
