"""Function tools the tool-calling tests declare (shared by the engine's and the gateway's tests).

Every argument is bounded (lengths, ranges, enums) so that even a random-weight model's constrained call
ends within a few dozen tokens.
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
# $defs with references: embedded in the "required" array schema, they must still resolve
ORDER = {
    "type": "function",
    "function": {
        "name": "order",
        "strict": True,
        "parameters": {
            "$defs": {
                "Item": {
                    "type": "object",
                    "properties": {
                        "sku": {"enum": ["a1", "b2"]},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"item": {"$ref": "#/$defs/Item"}, "gift": {"type": "boolean"}},
            "required": ["item", "gift"],
            "additionalProperties": False,
        },
    },
}
NO_ARGS = {
    "type": "function",
    "function": {"name": "ping", "description": "takes no arguments", "strict": True},
}
