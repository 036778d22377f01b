"""Pins what happens to each real-world schema of the corpus: `python tests/data/make_schema_corpus.py`.

The corpus: the SchemaStore schemas vendored by check-jsonschema (CI configurations,
issue forms, package and tool manifests), setuptools' pyproject schema, the draft-7
metaschema (all from packages the test extras install) and OpenAPI component schemas
(tests/data/openapi_schemas.json). For each: how it loads, which exact rewrites
normalisation applies, which keywords the grammar cannot enforce (strict refuses
naming them; lenient relaxes them), and whether the backend compiles the result.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections import Counter
from pathlib import Path

import xgrammar as xgr

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from features import json_schema as js  # noqa: E402

PINNED = Path(__file__).with_name("schema_corpus.json")


def corpus() -> dict[str, str]:
    """name -> schema text."""
    import check_jsonschema
    import jsonschema_specifications

    out = {}
    vendor = Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor"
    for f in sorted(vendor.glob("*.json")):
        out[f"schemastore/{f.stem}"] = f.read_text()
    try:  # in every venv made by Python <= 3.11; optional beyond
        import setuptools

        out["setuptools/pyproject"] = (
            Path(setuptools.__file__).parent / "config" / "setuptools.schema.json"
        ).read_text()
    except ImportError:
        pass
    out["jsonschema/draft7-metaschema"] = (
        Path(jsonschema_specifications.__file__).parent / "schemas" / "draft7" / "metaschema.json"
    ).read_text()
    for name, schema in json.loads(Path(__file__).with_name("openapi_schemas.json").read_text()).items():
        if not name.startswith("_"):
            out[f"openapi/{name}"] = json.dumps(schema)
    return out


def compiles(schema: js.Schema) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        return True
    except Exception:  # noqa: BLE001
        return False


def outcome(text: str, compile_all: bool = True) -> dict:
    """The pinned record of one schema; compile_all=False skips the informative compiles (tests)."""
    schema = js.load(text)
    normalised, rewrites, problems = js.normalise(schema)
    issues = js.unenforced(normalised, problems)
    return {
        "outcome": "refused in strict" if issues else ("normalised" if rewrites else "compiled exactly"),
        "rewrites": dict(sorted(Counter(r.keyword for r in rewrites).items())),
        "unenforced": dict(sorted(Counter(i.keyword for i in issues).items())),
        "first_unenforced": str(issues[0]) if issues else "",
        "compiles_as_given": compiles(schema) if compile_all else None,
        "compiles_normalised": compiles(normalised) if not issues and compile_all else None,
        "compiles_lenient": compiles(js.relax(normalised, issues)),
    }


def main() -> None:
    result = {name: outcome(text) for name, text in corpus().items()}
    PINNED.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {PINNED} ({len(result)} schemas)")


if __name__ == "__main__":
    main()
