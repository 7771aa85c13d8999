"""JSON schemas for constrained-decoding tests."""

from __future__ import annotations


def closed_object_schema(**properties: dict) -> dict:
    """An object schema with exactly these properties, all required and no others allowed, so
    `jsonschema.validate` of a constrained output checks every field of it."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }
