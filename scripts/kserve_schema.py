"""Extract KServe's API types from the ``kserve`` wheel on PyPI into tests/data/.

KServe's CRDs are generated from its Go API types; the ``kserve`` Python SDK ships the same
types as OpenAPI-generated classes (``kserve/models/*.py``: each field's JSON name, its type,
and whether it is required). The wheel ships no CRD YAML, and the package cannot be installed
beside the test tools (it needs protobuf 6), so this script reads the classes' source without
importing them and writes, for every KServe class, ``{json field: type}`` and the required
fields. tests/test_kserve.py turns that into a JSON Schema whose Kubernetes types
(``V1Container``...) refer to kubernetes-validate's own schemas.

    pip download --no-deps kserve==0.21.0 -d /tmp/kserve
    python scripts/kserve_schema.py /tmp/kserve/kserve-0.21.0-py3-none-any.whl
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "kserve-api-types.json"
_REQUIRED = re.compile(r"Invalid value for `(\w+)`, must not be `None`")


def _dict_value(cls: ast.ClassDef, name: str) -> dict[str, str]:
    for node in cls.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, dict)
            return value
    raise ValueError(f"{cls.name}: no {name}")


def classes(source: str) -> dict[str, dict[str, Any]]:
    """Each generated class in ``source``: its JSON fields' types and required fields."""
    out: dict[str, dict[str, Any]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name.startswith("V1"):
            types = _dict_value(node, "openapi_types")
            names = _dict_value(node, "attribute_map")
            out[node.name] = {
                "fields": {names[k]: t for k, t in types.items()},
                "required": sorted(names[k] for k in set(_REQUIRED.findall(source))),
            }
    return out


def main(wheel: str) -> None:
    found: dict[str, dict[str, Any]] = {}
    with zipfile.ZipFile(wheel) as z:
        for name in sorted(z.namelist()):
            if name.startswith("kserve/models/v1") and name.endswith(".py"):
                found.update(classes(z.read(name).decode()))
    doc = {"source": Path(wheel).name, "classes": found}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print(f"{OUT}: {len(found)} classes from {Path(wheel).name}")


if __name__ == "__main__":
    main(sys.argv[1])
