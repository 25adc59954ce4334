"""A corpus of JSON schemas for structured-output tests and ``bench/structured_output.py``.

Each entry is a realistic extraction shape (an invoice, a support ticket, a calendar event, ...) that
together cover the JSON Schema features a constrained decoder must honour: nested objects, arrays with
``minItems``/``maxItems``, ``enum``, ``const``, integers and numbers with inclusive and exclusive bounds,
booleans, ``null``, ``anyOf``, ``oneOf`` (with disjoint branches, so "exactly one" holds), strings with
``pattern``/``minLength``/``maxLength``, ``required`` vs optional properties, ``additionalProperties:
false`` and ``$ref``/``$defs``.

Invariant: every instance of every schema is finite and short. The demo models have random weights, so
nothing but the grammar ends a string, an array or an object: every string is bounded (``maxLength``,
``enum``, ``const`` or an anchored ``pattern`` of bounded length), every array has ``maxItems``, every object
has ``additionalProperties: false`` (an open object admits any number of keys of any length), and numbers
are bounded integers or numbers of bounded range (their fraction digits are the one unbounded part; the
tests size ``max_tokens`` for it). ``MAX_TOKENS`` is the budget the tests and the benchmark give one
response; ``test_structured_outputs`` checks that no response of the corpus is cut by it.

Patterns are anchored (``^...$``): JSON Schema's ``pattern`` is an unanchored search, and an anchored one
means the same thing to ``jsonschema`` and to the grammar compiler.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

# Output-token budget of one response: the longest instance the grammar allows is well under it with the
# demo tokenizer (4,096-entry byte-level BPE: JSON punctuation and digits are mostly a token each).
MAX_TOKENS = 400


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """A closed object: ``additionalProperties: false``; every property required unless ``required`` says."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


def _str(max_length: int, min_length: int = 0, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "minLength": min_length, "maxLength": max_length, **extra}


def _int(minimum: int, maximum: int, **extra: Any) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum, **extra}


SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _obj(
        {"name": _str(24, 1), "age": _int(0, 120), "email": _str(32, 3)},
        required=["name", "age"],
    ),
    "invoice": _obj(
        {
            "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4,6}$"},
            "currency": {"enum": ["USD", "EUR", "GBP", "JPY"]},
            "total": {"type": "number", "minimum": 0, "maximum": 100000, "multipleOf": 0.01},
            "paid": {"type": "boolean"},
            "lines": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": _obj({"sku": _str(8, 1), "quantity": _int(1, 99), "unit_price": _int(0, 9999)}),
            },
        }
    ),
    "address": _obj(
        {
            "street": _str(30, 1),
            "city": _str(20, 1),
            "postal_code": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
            "country": {"type": "string", "pattern": "^[A-Z]{2}$"},
            "unit": {"anyOf": [_str(6, 1), {"type": "null"}]},
        },
        required=["street", "city", "country"],
    ),
    "sentiment": _obj(
        {
            "label": {"enum": ["positive", "negative", "neutral", "mixed"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01},
        }
    ),
    "calendar_event": _obj(
        {
            "title": _str(30, 1),
            "date": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"},
            "start": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
            "duration_minutes": _int(5, 480),
            "attendees": {"type": "array", "maxItems": 4, "items": _str(16, 1)},
            "all_day": {"type": "boolean"},
        },
        required=["title", "date", "duration_minutes"],
    ),
    "support_ticket": _obj(
        {
            "priority": {"enum": ["low", "medium", "high", "urgent"]},
            "category": {"enum": ["billing", "login", "bug", "feature_request", "other"]},
            "summary": _str(40, 5),
            "customer_id": _int(1, 999999),
            "escalate": {"type": "boolean"},
        }
    ),
    "product": _obj(
        {
            "name": _str(24, 1),
            "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 5000, "multipleOf": 0.01},
            "in_stock": {"type": "boolean"},
            "tags": {
                "type": "array",
                "minItems": 0,
                "maxItems": 4,
                "items": {"enum": ["new", "sale", "eco", "kids"]},
            },
            "rating": {
                "anyOf": [{"type": "number", "minimum": 1, "maximum": 5, "multipleOf": 0.5}, {"type": "null"}]
            },
        },
        required=["name", "price", "in_stock"],
    ),
    "weather": _obj(
        {
            "city": _str(20, 1),
            "temperature_c": {
                "type": "number",
                "exclusiveMinimum": -90,
                "exclusiveMaximum": 60,
                "multipleOf": 0.1,
            },
            "humidity_pct": _int(0, 100),
            "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "fog", "storm"]},
        }
    ),
    "flight": _obj(
        {
            "flight_number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{1,4}$"},
            "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "seats": _int(1, 9),
            "cabin": {"enum": ["economy", "premium", "business", "first"]},
        }
    ),
    "recipe": _obj(
        {
            "title": _str(30, 1),
            "servings": _int(1, 12),
            "ingredients": {
                "type": "array",
                "minItems": 1,
                "maxItems": 4,
                "items": _obj(
                    {
                        "item": _str(16, 1),
                        "amount": {
                            "type": "number",
                            "exclusiveMinimum": 0,
                            "maximum": 1000,
                            "multipleOf": 0.25,
                        },
                        "unit": {"enum": ["g", "ml", "tsp", "tbsp", "cup", "pcs"]},
                    }
                ),
            },
            "vegetarian": {"type": "boolean"},
        }
    ),
    "order_status": _obj(
        {
            "order_id": {"type": "string", "pattern": "^[A-Z0-9]{8}$"},
            "status": {"enum": ["placed", "packed", "shipped", "delivered", "returned"]},
            "tracking": {"anyOf": [{"type": "string", "pattern": "^1Z[A-Z0-9]{6}$"}, {"type": "null"}]},
        }
    ),
    "contact_list": _obj(
        {
            "contacts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": _obj(
                    {"name": _str(20, 1), "phone": {"type": "string", "pattern": "^\\+[0-9]{7,12}$"}},
                    required=["name"],
                ),
            }
        }
    ),
    "classification": _obj(
        {
            "labels": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {"enum": ["spam", "ads", "personal", "work", "travel", "finance"]},
            },
            "is_spam": {"type": "boolean"},
        }
    ),
    "shape_oneof": _obj(
        {
            "shape": {
                "oneOf": [
                    _obj({"kind": {"const": "circle"}, "radius": _int(1, 100)}),
                    _obj({"kind": {"const": "rectangle"}, "width": _int(1, 100), "height": _int(1, 100)}),
                    _obj(
                        {
                            "kind": {"const": "triangle"},
                            "sides": {"type": "array", "minItems": 3, "maxItems": 3, "items": _int(1, 100)},
                        }
                    ),
                ]
            }
        }
    ),
    "payment_anyof": _obj(
        {
            "amount_cents": _int(1, 10000000),
            "method": {
                "anyOf": [
                    _obj({"type": {"const": "card"}, "last4": {"type": "string", "pattern": "^[0-9]{4}$"}}),
                    _obj(
                        {
                            "type": {"const": "iban"},
                            "iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{8,16}$"},
                        }
                    ),
                    _obj({"type": {"const": "cash"}}),
                ]
            },
        }
    ),
    "org_chart_refs": {
        "$defs": {
            "employee": _obj(
                {"name": _str(20, 1), "title": _str(20, 1), "level": _int(1, 10)},
                required=["name", "level"],
            )
        },
        **_obj(
            {
                "manager": {"$ref": "#/$defs/employee"},
                "reports": {"type": "array", "maxItems": 3, "items": {"$ref": "#/$defs/employee"}},
            }
        ),
    },
    "bank_transfer_refs": {
        "$defs": {
            "account": _obj(
                {"holder": _str(24, 1), "number": {"type": "string", "pattern": "^[0-9]{8,12}$"}}
            ),
            "money": _obj({"value": _int(1, 1000000), "currency": {"enum": ["USD", "EUR"]}}),
        },
        **_obj(
            {
                "from": {"$ref": "#/$defs/account"},
                "to": {"$ref": "#/$defs/account"},
                "amount": {"$ref": "#/$defs/money"},
                "memo": _str(30),
            },
            required=["from", "to", "amount"],
        ),
    },
    "api_version_const": _obj(
        {
            "version": {"const": "v2"},
            "kind": {"const": "ExtractionResult"},
            "ok": {"type": "boolean"},
            "count": _int(0, 50),
        }
    ),
    "measurements": _obj(
        {
            "sensor": {"type": "string", "pattern": "^S-[0-9]{3}$"},
            "readings": {
                "type": "array",
                "minItems": 2,
                "maxItems": 5,
                "items": {"type": "number", "minimum": -50, "maximum": 150, "multipleOf": 0.1},
            },
            "unit": {"const": "celsius"},
        }
    ),
    "nullable_fields": _obj(
        {
            "middle_name": {"type": ["string", "null"], "maxLength": 12},
            "nickname": {"anyOf": [_str(12, 1), {"type": "null"}]},
            "deleted_at": {"type": "null"},
            "score": {"type": ["integer", "null"], "minimum": 0, "maximum": 10},
        }
    ),
    "job_posting": _obj(
        {
            "title": _str(30, 3),
            "company": _str(24, 1),
            "remote": {"type": "boolean"},
            "salary": _obj({"min": _int(0, 500000), "max": _int(0, 500000)}),
            "seniority": {"enum": ["junior", "mid", "senior", "lead"]},
            "skills": {"type": "array", "minItems": 1, "maxItems": 4, "items": _str(12, 1)},
        },
        required=["title", "company", "remote", "seniority"],
    ),
    "book": _obj(
        {
            "title": _str(40, 1),
            "authors": {"type": "array", "minItems": 1, "maxItems": 3, "items": _str(24, 1)},
            "isbn": {"type": "string", "pattern": "^97[89][0-9]{10}$"},
            "year": _int(1450, 2030),
            "pages": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5000},
        },
        required=["title", "authors", "year"],
    ),
    "medication": _obj(
        {
            "drug": _str(24, 2),
            "dose_mg": {"type": "number", "exclusiveMinimum": 0, "maximum": 2000, "multipleOf": 0.5},
            "route": {"enum": ["oral", "iv", "im", "topical", "inhaled"]},
            "times_per_day": _int(1, 6),
            "with_food": {"type": "boolean"},
        }
    ),
    "geo_point": _obj(
        {
            "lat": {"type": "number", "minimum": -90, "maximum": 90, "multipleOf": 0.0001},
            "lon": {"type": "number", "minimum": -180, "maximum": 180, "multipleOf": 0.0001},
            "label": _str(20),
        },
        required=["lat", "lon"],
    ),
    "log_event": _obj(
        {
            "level": {"enum": ["DEBUG", "INFO", "WARN", "ERROR"]},
            "service": {"type": "string", "pattern": "^[a-z][a-z0-9-]{1,15}$"},
            "status_code": _int(100, 599),
            "latency_ms": {"type": "integer", "minimum": 0, "exclusiveMaximum": 60000},
            "message": _str(40, 1),
        }
    ),
    "survey_answer": _obj(
        {
            "respondent": _int(1, 10000),
            "answers": {
                "type": "array",
                "minItems": 3,
                "maxItems": 3,
                "items": _obj({"question": _int(1, 20), "score": _int(1, 5)}),
            },
            "comment": {"anyOf": [_str(40), {"type": "null"}]},
        },
        required=["respondent", "answers"],
    ),
    "matrix": _obj(
        {
            "rows": {
                "type": "array",
                "minItems": 2,
                "maxItems": 2,
                "items": {"type": "array", "minItems": 2, "maxItems": 3, "items": _int(-9, 9)},
            }
        }
    ),
    "feature_flags": _obj(
        {
            "dark_mode": {"type": "boolean"},
            "beta": {"type": "boolean"},
            "rollout_pct": _int(0, 100),
            "regions": {"type": "array", "maxItems": 3, "items": {"enum": ["eu", "us", "apac"]}},
        },
        required=["dark_mode"],
    ),
    "nested_company": _obj(
        {
            "company": _obj(
                {
                    "name": _str(24, 1),
                    "hq": _obj({"city": _str(16, 1), "country": {"type": "string", "pattern": "^[A-Z]{2}$"}}),
                    "departments": {
                        "type": "array",
                        "minItems": 1,
                        "maxItems": 2,
                        "items": _obj({"name": _str(16, 1), "headcount": _int(1, 5000)}),
                    },
                }
            ),
            "public": {"type": "boolean"},
        }
    ),
    "ticket_seat": _obj(
        {
            "section": {"type": "string", "pattern": "^[A-H]$"},
            "row": _int(1, 40),
            "seat": _int(1, 30),
            "price": {"type": "number", "minimum": 10, "exclusiveMaximum": 500, "multipleOf": 0.01},
            "accessible": {"type": "boolean"},
        }
    ),
    "yes_no_answer": _obj(
        {"answer": {"enum": ["yes", "no", "unsure"]}, "reason": _str(30, 1)},
        required=["answer"],
    ),
    "color_palette": _obj(
        {
            "name": _str(20, 1),
            "colors": {
                "type": "array",
                "minItems": 2,
                "maxItems": 4,
                "items": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
            },
        }
    ),
    "entity_mentions": _obj(
        {
            "entities": {
                "type": "array",
                "maxItems": 3,
                "items": _obj(
                    {
                        "text": _str(20, 1),
                        "type": {"enum": ["PERSON", "ORG", "LOC", "DATE"]},
                        "start": _int(0, 2000),
                        "end": _int(0, 2000),
                    }
                ),
            }
        }
    ),
    "top_level_array": {
        "type": "array",
        "minItems": 1,
        "maxItems": 4,
        "items": _obj({"id": _int(1, 1000), "done": {"type": "boolean"}}),
    },
}

# One prompt per schema, cycled: the demo models are random, so the text only varies the outputs.
PROMPTS: tuple[str, ...] = (
    "Extract the fields from this document as JSON.",
    "Invoice INV-20931 for 3 widgets at $12 each, paid in full on Monday.",
    "Meet Dana Kim (34, dana@example.com) at 14:30 on 2026-03-02 for ninety minutes in Lisbon.",
    "The customer says the app logs them out every five minutes; please escalate, it is urgent.",
    "Return the answer in the requested structure.",
)


def prompt_for(index: int, name: str) -> str:
    return f"{PROMPTS[index % len(PROMPTS)]} Output schema: {name}.\n"


def validate_instance(text: str, schema: dict[str, Any]) -> Any:
    """The JSON value ``text`` holds, after checking it against ``schema`` with ``jsonschema`` (draft 2020-12).

    Raises ``ValueError`` (not JSON) or ``jsonschema.ValidationError``. Numbers are read as ``Decimal`` on
    both sides, so ``multipleOf: 0.01`` is exact (as floats, 0.29 / 0.01 is not an integer)."""
    import jsonschema

    instance = json.loads(text, parse_float=Decimal)
    exact_schema = json.loads(json.dumps(schema), parse_float=Decimal)
    jsonschema.validate(instance, exact_schema, cls=jsonschema.Draft202012Validator)
    return instance


def corpus_failures(outputs, names: list[str]) -> list[str]:
    """Why completions are not complete, valid instances: request ``i`` of ``outputs`` (``RequestOutput``s)
    was constrained by ``SCHEMAS[names[i]]``; each completion must end with "stop" (its grammar completed)
    and validate. An empty list: all of them are."""
    import jsonschema

    failures = []
    for name, out in zip(names, outputs, strict=True):
        for completion in out.outputs:
            if completion.finish_reason != "stop":
                failures.append(
                    f"{name}: finish {completion.finish_reason} after {len(completion.token_ids)} tokens"
                )
                continue
            try:
                validate_instance(completion.text, SCHEMAS[name])
            except (ValueError, jsonschema.ValidationError) as e:
                failures.append(f"{name}: {type(e).__name__}: {str(e)[:200]} in {completion.text[:300]!r}")
    return failures
