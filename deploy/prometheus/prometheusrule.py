"""Wrap rtserve-rules.yml in a Prometheus Operator PrometheusRule (k8s/prometheusrule.yaml).

    python deploy/prometheus/prometheusrule.py > deploy/k8s/prometheusrule.yaml

tests/test_deploy.py checks that the two files hold the same rules.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

RULES = Path(__file__).resolve().parent / "rtserve-rules.yml"
HEADER = """\
# Generated from deploy/prometheus/rtserve-rules.yml (edit that file, then run
#   python deploy/prometheus/prometheusrule.py > deploy/k8s/prometheusrule.yaml).
# For the Prometheus Operator; its ruleSelector must match these labels (kube-prometheus-stack
# selects release=<its release name> by default).
"""


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the PromQL) as literal blocks, as in the rules file."""


def _block_strings(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _block_strings)


def prometheus_rule() -> dict[str, Any]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "rtserve",
            "labels": {"app": "rtserve", "release": "kube-prometheus-stack"},
        },
        "spec": {"groups": groups},
    }


def main() -> None:
    body = yaml.dump(prometheus_rule(), Dumper=_Dumper, sort_keys=False, width=100)
    sys.stdout.write(HEADER + body)


if __name__ == "__main__":
    main()
