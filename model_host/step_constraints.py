"""A session's structured output on a model service: set by its first step (keep = 0), compiled off
the event loop before that step enters the engine, and kept by the session's later steps."""

from __future__ import annotations

from typing import Any

from serving.constraints import ConstraintSpec, Grammars, SessionConstraint
from serving.errors import ServiceError, invalid_argument


def spec_to_compile(grammars: Grammars | None, step: Any) -> ConstraintSpec | None:
    """The constraint of a first step (keep = 0) that is not compiled yet; None for any other step,
    and for a malformed constraint (the step's entry answers it)."""
    if step.keep or not step.HasField("structured_output") or grammars is None:
        return None
    try:
        spec = ConstraintSpec.from_proto(step.structured_output)
    except ServiceError:
        return None
    return spec if spec is not None and grammars.cached(spec) is None else None


def first_step_constraint(grammars: Grammars | None, step: Any) -> SessionConstraint | None:
    """The constraint a session's first step sets (None: unconstrained); INVALID_ARGUMENT naming the
    field when this replica cannot apply it."""
    if not step.HasField("structured_output"):
        return None
    spec = ConstraintSpec.from_proto(step.structured_output)
    if spec is None:
        return None
    if grammars is None:
        raise invalid_argument(
            "structured_output: this replica applies no constraints (its checkpoint has no fast tokenizer); "
            "see ModelInfo.structured_output_kinds"
        )
    if step.constraint_start > len(step.append_token_ids):
        length = len(step.append_token_ids)
        raise invalid_argument(f"constraint_start {step.constraint_start} is past the sequence's {length} tokens")
    template = grammars.cached(spec) or grammars.compile(spec)  # compiled by now (spec_to_compile)
    return grammars.session(template, step.constraint_start)
