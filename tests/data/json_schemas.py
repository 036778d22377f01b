"""Real-world-shaped JSON schemas for the constrained-decoding suite: (prompt, schema).

Emails use a bounded pattern: xgrammar's "format": "email" ignores maxLength, so a
sampling 135M model can ramble in the local part until max_new_tokens.
"""

SCHEMAS: list[tuple[str, dict]] = [
    (
        "Describe a person.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "age"],
        },
    ),
    (
        "Give a product.",
        {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "price": {"type": "number", "minimum": 0, "maximum": 10000},
                "in_stock": {"type": "boolean"},
            },
            "required": ["sku", "price", "in_stock"],
        },
    ),
    (
        "List three colors.",
        {
            "type": "array",
            "items": {"type": "string", "enum": ["red", "green", "blue", "yellow", "black"]},
            "minItems": 3,
            "maxItems": 3,
        },
    ),
    (
        "Rate a movie.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 60},
                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["title", "stars"],
        },
    ),
    (
        "An address.",
        {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 50},
                "city": {"type": "string", "maxLength": 30},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
        },
    ),
    (
        "A todo list.",
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "task": {"type": "string", "maxLength": 40},
                            "done": {"type": "boolean"},
                        },
                        "required": ["task", "done"],
                    },
                    "minItems": 1,
                    "maxItems": 3,
                }
            },
            "required": ["items"],
        },
    ),
    (
        "Weather report.",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                "condition": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow"]},
            },
            "required": ["city", "temperature_c", "condition"],
        },
    ),
    (
        "An event date.",
        {
            "type": "object",
            "properties": {
                "event": {"type": "string", "maxLength": 40},
                "date": {"type": "string", "format": "date"},
            },
            "required": ["event", "date"],
        },
    ),
    (
        "A contact.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,10}\\.(com|org|net)$"},
            },
            "required": ["name", "email"],
        },
    ),
    (
        "A point.",
        {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -100, "maximum": 100},
                "y": {"type": "integer", "minimum": -100, "maximum": 100},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
    ),
    (
        "A book with optional subtitle.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 50},
                "subtitle": {"type": "string", "maxLength": 50},
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
            },
            "required": ["title", "year"],
        },
    ),
    (
        "A tree node.",
        {
            "$defs": {
                "leaf": {
                    "type": "object",
                    "properties": {"value": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["value"],
                }
            },
            "type": "object",
            "properties": {
                "root": {"$ref": "#/$defs/leaf"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 2},
            },
            "required": ["root", "children"],
        },
    ),
    (
        "Either a cat or a dog.",
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"cat": {"type": "string", "maxLength": 20}},
                    "required": ["cat"],
                },
                {
                    "type": "object",
                    "properties": {"dog": {"type": "string", "maxLength": 20}},
                    "required": ["dog"],
                },
            ]
        },
    ),
    (
        "A status code.",
        {
            "type": "object",
            "properties": {"code": {"type": "integer", "enum": [200, 404, 500]}, "ok": {"type": "boolean"}},
            "required": ["code", "ok"],
        },
    ),
    (
        "Scores of three players.",
        {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 100},
            "minItems": 2,
            "maxItems": 4,
        },
    ),
    (
        "A user with a role.",
        {
            "type": "object",
            "properties": {
                "username": {"type": "string", "pattern": "^[a-z]{3,10}$"},
                "role": {"type": "string", "enum": ["admin", "editor", "viewer"]},
            },
            "required": ["username", "role"],
        },
    ),
    (
        "A matrix.",
        {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 2,
            },
            "minItems": 2,
            "maxItems": 2,
        },
    ),
    (
        "An order.",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 1, "maximum": 99999},
                "lines": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "qty": {"type": "integer", "minimum": 1, "maximum": 10},
                            "item": {"type": "string", "maxLength": 20},
                        },
                        "required": ["qty", "item"],
                    },
                    "minItems": 1,
                    "maxItems": 2,
                },
                "total": {"type": "number", "minimum": 0, "maximum": 1000},
            },
            "required": ["id", "lines", "total"],
        },
    ),
    ("A flag.", {"type": "boolean"}),
    ("A percentage.", {"type": "number", "minimum": 0, "maximum": 100}),
    (
        "A config.",
        {
            "type": "object",
            "properties": {
                "debug": {"type": "boolean"},
                "level": {"type": "string", "enum": ["low", "mid", "high"]},
                "retries": {"type": "integer", "minimum": 0, "maximum": 5},
            },
            "required": ["debug", "level", "retries"],
            "additionalProperties": False,
        },
    ),
    (
        "A nullable note.",
        {
            "type": "object",
            "properties": {"note": {"anyOf": [{"type": "string", "maxLength": 30}, {"type": "null"}]}},
            "required": ["note"],
        },
    ),
    ("A version.", {"type": "string", "pattern": "^v[0-9]\\.[0-9]{1,2}\\.[0-9]{1,2}$"}),
    (
        "A uuid record.",
        {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    ),
]
