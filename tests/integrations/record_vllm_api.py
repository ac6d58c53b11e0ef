"""Record the connector interface of a vLLM release (run by hand; no vLLM import, no GPU).

    pip download --no-deps vllm==0.34.0 -d /tmp/w      # the official wheel (239 MB; 0.33.0: 336 MB)
    python tests/integrations/record_vllm_api.py /tmp/w/vllm-0.34.0-*.whl \
        > tests/integrations/vllm_0_34_connector_api.json

Reads `vllm/distributed/kv_transfer/kv_connector/v1/base.py` out of the wheel (or a base.py given
directly) with `ast`, and writes every method of `KVConnectorBase_V1`, and of the `SupportsHMA`
mixin (a connector's word that it moves every KV cache group of a hybrid model): its kind
(instance, classmethod, staticmethod, property), whether it is abstract, and its parameter names.
`test_vllm_api.py` checks the connector against the record.
"""
from __future__ import annotations

import ast
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
CLASS = "KVConnectorBase_V1"
MIXINS = ("SupportsHMA",)


def methods(source: str, cls: str = CLASS) -> dict[str, dict]:
    """{name: {"kind", "abstract", "params"}} of the class's methods, read off the source."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    out = {}
    for item in node.body:
        if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        decorators = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in item.decorator_list}
        kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decorators), "instance")
        args = item.args
        params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]
        if args.vararg:
            params.append("*" + args.vararg.arg)
        if args.kwarg:
            params.append("**" + args.kwarg.arg)
        out[item.name] = {"kind": kind, "abstract": "abstractmethod" in decorators, "params": params}
    return out


def main(path: str) -> int:
    if path.endswith(".whl"):
        with zipfile.ZipFile(path) as wheel:
            source = wheel.read(BASE).decode()
            version = re.search(r"vllm-([^-]+)-", path.rsplit("/", 1)[-1]).group(1)
    else:
        source, version = Path(path).read_text(), "unknown"
    record = {"vllm": version, "file": BASE, "sha256": hashlib.sha256(source.encode()).hexdigest(),
              "class": CLASS, "methods": methods(source),
              "mixins": {name: methods(source, name) for name in MIXINS}}
    json.dump(record, sys.stdout, indent=1, sort_keys=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
