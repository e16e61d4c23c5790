"""A real Ray Serve deployment of ``rtserve.ray`` on 127.0.0.1, for the suites that ask every
entry the same requests (``test_entry_security.py``, ``test_api_entries.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.cache_fixtures import free_port


@contextmanager
def ray_serve_base(repo: Path, config: Path) -> Iterator[str]:
    """Ray started, ``rtserve.ray.app(repo)`` served behind Ray's proxy: its base URL."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    import rtserve.ray as rtserve_ray

    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_worker_niceness", "0")
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            application = rtserve_ray.app(repo, num_cpus=0.5, config_file=str(config))
            serve.run(application, name="rtserve", route_prefix="/")
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()
            ray.shutdown()
