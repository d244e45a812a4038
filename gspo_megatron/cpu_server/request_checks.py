"""How sglang's HTTP server refuses a request body before its scheduler sees it: FastAPI validates
the body (msgspec structs through pydantic, ``utils/msgspec_utils.py``
``msgspec_struct_pydantic_core_schema``) and answers 422 with pydantic's error list."""

from __future__ import annotations

from typing import Sequence


def literal_refusal(body: dict, field: str, allowed: Sequence[str]) -> tuple[int, dict] | None:
    """Pydantic's 422 ``literal_error`` for ``body[field]`` outside ``Literal[*allowed]``; None when
    the field is absent (its default) or one of the values."""
    if field not in body or body[field] in allowed:
        return None
    quoted = [f"'{v}'" for v in allowed]
    expected = quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
    return 422, {
        "detail": [
            {
                "type": "literal_error",
                "loc": ["body", field],
                "msg": f"Input should be {expected}",
                "input": body[field],
                "ctx": {"expected": expected},
            }
        ]
    }
