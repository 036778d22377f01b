"""The compose files against the Compose Specification's JSON schema — the format Compose v2
(`docker compose`) reads and validates — without Docker. The stack itself runs under Compose v1.29
in test_compose_stack.py (Debian ships no v2 plugin); this keeps the files v2-valid too."""

from __future__ import annotations

import json
from pathlib import Path

import check_jsonschema
import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(
    ["docker-compose.yml", *(str(p.relative_to(ROOT)) for p in (ROOT / "deploy").glob("compose*.yml"))]
)


@pytest.fixture(scope="module")
def compose_spec() -> jsonschema.Validator:
    path = Path(check_jsonschema.__file__).parent / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(path.read_text())
    return jsonschema.validators.validator_for(schema)(schema)


@pytest.mark.parametrize("name", FILES)
def test_compose_file_follows_the_compose_spec(name, compose_spec):
    doc = yaml.safe_load((ROOT / name).read_text())
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in compose_spec.iter_errors(doc)]
    assert errors == []
    assert "version" not in doc  # obsolete in the spec: v2 warns on it


def test_a_broken_file_is_caught(compose_spec):
    doc = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    doc["services"]["zerogap"]["healthchek"] = {"test": ["CMD", "true"]}  # a misspelt key
    assert list(compose_spec.iter_errors(doc))
