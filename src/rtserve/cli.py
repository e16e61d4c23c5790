"""The ``rtserve`` command: ``rtserve serve | export | optimize | ...``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rtserve import __version__
from rtserve.errors import ConfigError

# HTTP transport limits: flag --http-<name> sets ServerConfig.http_<name>.
_HTTP_LIMITS: dict[str, tuple[type, str]] = {
    "max_url_bytes": (int, "longest request URL in bytes (default 8192; 414 beyond)"),
    "max_headers": (int, "most request headers (default 100; 431 beyond)"),
    "max_header_bytes": (int, "largest single header in bytes (default 16384; 431 beyond)"),
    "max_head_bytes": (int, "largest request line + headers in bytes (default 65536)"),
    "idle_timeout_s": (float, "close keep-alive connections idle this long (default 75)"),
    "header_timeout_s": (float, "seconds to receive a request's headers (default 20; 408)"),
    "body_timeout_s": (float, "longest silence while a body arrives (default 30; 408)"),
    "max_connections": (int, "open HTTP connections; more get 503 (default 10000)"),
}


# Decoding budget per request: flag --<name> sets ServerConfig.<name>.
_DECODE_LIMITS: dict[str, str] = {
    "max_tensor_elements": "tensor elements per request (default 16777216)",
    "max_bytes_elements": "BYTES elements per request (default 65536)",
    "max_json_depth": "nesting of JSON parameters (default 32)",
    "max_json_containers": "JSON lists/objects per request header (default 65536)",
    "max_decompressed_bytes": "largest gzip/deflate body once decompressed (default 64 MiB)",
}


def _boolean(text: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off), as Triton's boolean flags take."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _cold_start(args: argparse.Namespace) -> int:
    from rtserve.coldstart import run_cli

    return run_cli(args.repository, args.model, args.runs, args.json)


def _serve(args: argparse.Namespace) -> int:
    from rtserve.config import load_server_config
    from rtserve.server.app import serve

    try:
        config = load_server_config(
            args.config,
            model_repository=args.model_repository,
            host=args.host,
            http_port=args.http_port,
            grpc_port=args.grpc_port,
            grpc_server=args.grpc_server,
            max_request_bytes=args.max_request_bytes,
            grace_period_s=args.grace_period,
            log_level=args.log_level,
            model_control_mode=args.model_control_mode,
            log_format=args.log_format,
            access_log=True if args.access_log else None,
            trace_endpoint=args.trace_endpoint,
            trace_sample_ratio=args.trace_sample_ratio,
            auth_file=args.auth_file,
            rate_limit_rps=args.rate_limit,
            rate_limit_burst=args.rate_burst,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            repository_poll_secs=args.repository_poll_secs,
            load_models=tuple(args.load_model) if args.load_model else None,
            strict_readiness=args.strict_readiness,
            exit_on_error=args.exit_on_error,
            shared_memory=args.shared_memory,
            shared_memory_max_regions=args.shared_memory_max_regions,
            **{f"http_{name}": getattr(args, f"http_{name}") for name in _HTTP_LIMITS},
            **{name: getattr(args, name) for name in _DECODE_LIMITS},
        )
    except ConfigError as exc:
        print(f"rtserve: {exc}", file=sys.stderr)
        return 2
    try:
        return serve(config, args.ports_file, workers=args.workers)
    except (ConfigError, OSError) as exc:
        print(f"rtserve: {exc}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rtserve",
        description="Serve models over KServe V2 (HTTP and gRPC) and an OpenAI-compatible API; "
        "export, optimize and measure them. Start with: rtserve serve --model-repository DIR",
    )
    parser.add_argument("--version", action="version", version=f"rtserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _register_serve(sub)
    _register_cold_start(sub)
    try:
        from rtserve.optimize.cli import register
    except ImportError:
        pass
    else:
        register(sub)
    return parser


def _register_serve(sub: Any) -> None:
    s = sub.add_parser("serve", help="serve a model repository over HTTP and gRPC (KServe V2)")
    s.add_argument(
        "--model-repository",
        type=Path,
        help="directory of <model>/config.yaml + <version>/model.onnx",
    )
    s.add_argument("--config", type=Path, help="server config YAML (flags override it)")
    s.add_argument("--host", help="address to bind (default 127.0.0.1)")
    s.add_argument("--http-port", type=int, help="HTTP port (default 8000; 0 picks a free one)")
    s.add_argument("--grpc-port", type=int, help="gRPC port (default 8001; 0 picks a free one)")
    s.add_argument(
        "--grpc-server",
        choices=["rtserve", "grpcio"],
        help="gRPC transport: rtserve's own HTTP/2 (default) or grpcio's grpc.aio servers",
    )
    s.add_argument("--max-request-bytes", type=int, help="largest accepted request body")
    s.add_argument("--grace-period", type=float, help="seconds to finish requests on SIGTERM")
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    for name, (kind, help_text) in _HTTP_LIMITS.items():
        s.add_argument(f"--http-{name.replace('_', '-')}", type=kind, help=help_text)
    for name, help_text in _DECODE_LIMITS.items():
        s.add_argument(f"--{name.replace('_', '-')}", type=int, help=help_text)
    s.add_argument(
        "--auth-file",
        help="YAML of API keys (tokens, allowed models, admin); default: no authentication",
    )
    s.add_argument(
        "--rate-limit", type=float, help="requests/s per client address (default: no limit)"
    )
    s.add_argument("--rate-burst", type=int, help="requests a client may send at once")
    s.add_argument("--tls-cert", help="PEM certificate chain: serve HTTP and gRPC over TLS")
    s.add_argument("--tls-key", help="PEM private key of --tls-cert")
    s.add_argument("--tls-client-ca", help="PEM CA: require client certificates (mTLS)")
    _observability_args(s)
    _model_control_args(s)
    s.add_argument(
        "--shared-memory",
        choices=["none", "system"],
        help="system: let clients pass tensors through files in /dev/shm (Triton's system "
        "shared memory extension; needs --workers 1); none: off (default)",
    )
    s.add_argument(
        "--shared-memory-max-regions",
        type=int,
        help="most shared memory regions registered at once (default 64)",
    )
    s.add_argument(
        "--workers", type=int, default=1, help="server processes sharing the ports (default 1)"
    )
    s.add_argument("--ports-file", type=Path, help="write the bound ports as JSON once ready")
    s.set_defaults(func=_serve)


def _observability_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--log-format", choices=["text", "json"], help="log lines (default text)")
    s.add_argument(
        "--access-log", action="store_true", help="log one line per request (default off)"
    )
    s.add_argument(
        "--trace-endpoint",
        help="export OpenTelemetry spans over OTLP/HTTP to this URL "
        "(e.g. http://127.0.0.1:4318/v1/traces; default off; needs rtserve[tracing])",
    )
    s.add_argument(
        "--trace-sample-ratio",
        type=float,
        help="fraction of new traces sampled (default 1.0; a client's sampled traceparent "
        "is always followed)",
    )


def _model_control_args(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--model-control-mode",
        choices=["none", "poll", "explicit"],
        help="none: load the repository at start (default); poll: also reload what changes "
        "on disk; explicit: load/unload through the API (and --load-model at start)",
    )
    s.add_argument(
        "--repository-poll-secs", type=float, help="poll mode: seconds between scans (default 15)"
    )
    s.add_argument(
        "--load-model",
        action="append",
        metavar="NAME",
        help="explicit mode: a model to load at start (repeatable; '*' loads all)",
    )
    s.add_argument(
        "--strict-readiness",
        type=_boolean,
        nargs="?",
        const=True,
        metavar="true|false",
        help="true (default): /v2/health/ready answers 503 until every model asked for is "
        "ready; false: ready once started, whatever failed to load",
    )
    s.add_argument(
        "--exit-on-error",
        type=_boolean,
        nargs="?",
        const=True,
        metavar="true|false",
        help="stop at start, exit status 1, naming the model, when a model fails to load "
        "(default false)",
    )


def _register_cold_start(sub: Any) -> None:
    c = sub.add_parser(
        "cold-start",
        help="time a fresh process: import, model load, warmup, first answer (ms)",
    )
    c.add_argument("repository", type=Path, help="model repository")
    c.add_argument("--model", action="append", default=[], help="a model (repeatable; default all)")
    c.add_argument("--runs", type=int, default=3, help="fresh processes per model (median)")
    c.add_argument("--json", action="store_true", help="JSON instead of a Markdown table")
    c.set_defaults(func=_cold_start)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
