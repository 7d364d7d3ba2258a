"""The one configured converter, and the helpers every caller uses with it.

:data:`converter` is a cattrs orjson converter configured to be strict about primitive types
(``"5"`` is not an int, ``5`` is not a str) so that a wrong type is a 400 naming the JSON path,
never a silent coercion.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, TypeVar

import attrs
import cattrs
import cattrs.gen
import orjson
from cattrs.preconf.orjson import make_converter

from ..errors import BadRequest
from .events import DeltaPartType, EventKind, MessageDelta, PayloadType, ToolOutput
from .messages import PART_TAGS, PART_TYPES, FinishReason, Part, Role
from .objects import AgentEvent, JobState, McpState, RunStatus, Todo, TodoStatus

if TYPE_CHECKING:
    import enum

T = TypeVar("T")


def _strict(kind: type[Any], *, exclude: tuple[type[Any], ...] = ()) -> Any:
    def structure(value: Any, _: Any) -> Any:
        if not isinstance(value, kind) or isinstance(value, exclude):
            raise TypeError(f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    return structure


def _structure_float(value: Any, _: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected number, got {type(value).__name__}")
    return float(value)


def _structure_enum(value: Any, cls: type[enum.Enum]) -> Any:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{value!r} is not one of {allowed}") from None


def _make_converter() -> cattrs.Converter:
    conv = make_converter(forbid_extra_keys=False)
    conv.register_structure_hook(str, _strict(str))
    conv.register_structure_hook(int, _strict(int, exclude=(bool,)))
    conv.register_structure_hook(bool, _strict(bool))
    conv.register_structure_hook(float, _structure_float)
    # Our enums subclass str; name each one so the strict str hook above does not take them.
    for enum_cls in (
        FinishReason,
        Role,
        RunStatus,
        DeltaPartType,
        EventKind,
        PayloadType,
        McpState,
        JobState,
        TodoStatus,
    ):
        conv.register_structure_hook(enum_cls, _structure_enum)

    def unstructure_part(part: Any) -> dict[str, Any]:
        return {"type": PART_TAGS[type(part)], "data": conv.unstructure(part, type(part))}

    def structure_part(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise TypeError(f"expected a part object, got {type(value).__name__}")
        tag = value.get("type")
        cls = PART_TYPES.get(tag) if isinstance(tag, str) else None
        if cls is None:
            raise ValueError(f"unknown part type {tag!r}; expected one of {sorted(PART_TYPES)}")
        return conv.structure(value.get("data") or {}, cls)

    for cls in PART_TAGS:
        conv.register_unstructure_hook(cls, _attrs_unstructure(conv, cls))
    # ``progress`` and ``done`` belong to ``summarize`` events only, ``mcp`` to ``mcp`` events:
    # each is left out of the other events.
    from cattrs.gen import make_dict_unstructure_fn, override

    conv.register_unstructure_hook(
        AgentEvent,
        make_dict_unstructure_fn(
            AgentEvent,
            conv,
            progress=override(omit_if_default=True),
            done=override(omit_if_default=True),
            mcp=override(omit_if_default=True),
        ),
    )
    # A delta that does not create a tool call part leaves these two out (PROTOCOL §6.6): every
    # delta would otherwise carry them empty. A missing key structures as "".
    conv.register_unstructure_hook(
        MessageDelta,
        make_dict_unstructure_fn(
            MessageDelta,
            conv,
            tool_call_id=override(omit_if_default=True),
            tool_name=override(omit_if_default=True),
        ),
    )
    # A delta's index and offset are never negative. The check is here, where a delta comes in,
    # rather than a validator of the class: the server builds one per streamed token, and an
    # attrs validator costs several times the rest of the construction.
    structure_delta = conv.get_structure_hook(MessageDelta)

    def structure_checked_delta(value: Any, cls: Any) -> MessageDelta:
        delta: MessageDelta = structure_delta(value, cls)
        for name in ("part", "offset"):
            if getattr(delta, name) < 0:
                raise ValueError(f"'{name}' must be >= 0: {getattr(delta, name)}")
        return delta

    conv.register_structure_hook(MessageDelta, structure_checked_delta)
    # A job's last piece says so with its exit code; other pieces leave both out.
    conv.register_unstructure_hook(
        ToolOutput,
        make_dict_unstructure_fn(
            ToolOutput,
            conv,
            job_id=override(omit_if_default=True),
            dropped=override(omit_if_default=True),
            done=override(omit_if_default=True),
            exit_code=override(omit_if_default=True),
        ),
    )
    conv.register_unstructure_hook_func(
        lambda t: t is Part,
        lambda part: unstructure_part(part),
    )
    conv.register_structure_hook_func(
        lambda t: t is Part,
        structure_part,
    )
    return conv


def _attrs_unstructure(conv: cattrs.Converter, cls: type[Any]) -> Any:
    from cattrs.gen import make_dict_unstructure_fn

    return make_dict_unstructure_fn(cls, conv)


converter: Final = _make_converter()


def dumps(obj: Any) -> bytes:
    """Encode a wire object (or plain data) as JSON bytes."""
    return orjson.dumps(converter.unstructure(obj))


def unstructure(obj: Any) -> Any:
    """A wire object as plain JSON-ready data (the one converter's view of it)."""
    return converter.unstructure(obj)


def parts_to_json(parts: list[Part]) -> str:
    return orjson.dumps([converter.unstructure(p, Part) for p in parts]).decode()


def parts_from_json(raw: str) -> list[Part]:
    return converter.structure(orjson.loads(raw), list[Part])


def todos_to_json(todos: list[Todo]) -> str:
    return orjson.dumps([converter.unstructure(t, Todo) for t in todos]).decode()


def todos_from_json(raw: str) -> list[Todo]:
    return converter.structure(orjson.loads(raw), list[Todo])


def describe_error(exc: BaseException, root: str = "$") -> str:
    """Turn a cattrs structuring error into ``$.path: problem`` lines."""
    if isinstance(exc, (cattrs.ClassValidationError, cattrs.IterableValidationError)):
        messages = cattrs.transform_error(exc, path=root, format_exception=_format_exception)
        return "; ".join(messages)
    return f"{root}: {exc}"


def _format_exception(exc: BaseException, type_: Any) -> str:
    """cattrs' wording, except that a validator's own message (which names the field and the
    rule, such as ``'offset' must be >= 0: -3``) is kept instead of a bare "invalid value"."""
    if type(exc) is ValueError and exc.args:
        return f"invalid value ({exc})"
    return cattrs.v.format_exception(exc, type_)


def structure(data: Any, cls: type[T], *, what: str = "request body") -> T:
    """Structure ``data`` into ``cls``, raising :class:`BadRequest` with JSON paths on failure."""
    if not isinstance(data, dict) and attrs.has(cls):
        raise BadRequest(
            f"{what} must be a JSON object, got {type(data).__name__}; "
            "send a JSON object as described in docs/protocol.md"
        )
    try:
        return converter.structure(data, cls)
    except Exception as exc:
        raise BadRequest(f"invalid {what}: {describe_error(exc)}") from None


def loads_body(raw: bytes | str, cls: type[T], *, what: str = "request body") -> T:
    """Parse JSON text and structure it, with 400-class errors that say what to fix."""
    try:
        data = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"{what} is not valid JSON ({exc}); send a JSON object") from None
    return structure(data, cls, what=what)
