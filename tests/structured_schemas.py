"""Twenty JSON schemas a user would write for data extraction and tool calls (nested objects, arrays with
min/max items, enums, bounded integers and numbers, strings with patterns and formats, optional and
required fields), shared by the structured-output tests. Strings and arrays are bounded so that even a
random-weight model, which never chooses to close a string, ends them."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: list[dict] = [
    # 0: a flat record, all required
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    # 1: an enum and a boolean
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
     "required": ["color", "bright"]},
    # 2: a bounded number
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}}, "required": ["score"]},
    # 3: an array with min and max items
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    # 4: a nested object
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999}, "name": NAME}, "required": ["id", "name"]}},
     "required": ["user"]},
    # 5: a string with a pattern
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    # 6: a date format
    {"type": "object", "properties": {"born": {"type": "string", "format": "date"}}, "required": ["born"]},
    # 7: an email format
    {"type": "object", "properties": {"email": {"type": "string", "format": "email"}},
     "required": ["email"]},
    # 8: a uuid format
    {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]},
    # 9: optional fields beside a required one
    {"type": "object", "properties": {"title": NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                      "rating": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["title"]},
    # 10: an array of objects
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    # 11: an enum of integers and a nullable field
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]},
                                      "parent": {"type": ["integer", "null"]}}, "required": ["level", "parent"]},
    # 12: exclusive bounds
    {"type": "object", "properties": {"ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}},
     "required": ["ratio"]},
    # 13: a top-level array
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4},
    # 14: a tool call
    {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": {"type": "object", "properties": {
        "city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}},
     "required": ["name", "arguments"]},
    # 15: a date-time format
    {"type": "object", "properties": {"at": {"type": "string", "format": "date-time"}}, "required": ["at"]},
    # 16: a host name pattern and a port (not format ipv4: xgrammar's accepts leading zeros, "10.01.0.1", which
    # jsonschema's checker refuses)
    {"type": "object", "properties": {"host": {"type": "string", "pattern": "^[a-z]{1,8}\\.example\\.(com|org)$"},
                                      "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
     "required": ["host", "port"]},
    # 17: a list of enum values, unique items
    {"type": "object", "properties": {"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]},
                                               "minItems": 1, "maxItems": 3}}, "required": ["days"]},
    # 18: anyOf
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                          {"type": "string", "maxLength": 4}]}},
     "required": ["value"]},
    # 19: two levels of nesting, optional and required fields at each
    {"type": "object", "properties": {
        "order": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 999},
            "customer": {"type": "object", "properties": {"name": NAME, "vip": {"type": "boolean"}},
                         "required": ["name"]},
            "note": {"type": "string", "maxLength": 10}},
            "required": ["id", "customer"]}},
     "required": ["order"]},
]
assert len(SCHEMAS) == 20
