"""``load_config``: a JSON (or YAML) file plus ``a.b.c=value`` overrides, validated, errors by field path."""

from __future__ import annotations

import copy
import difflib
import json
import sys
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, JsonValue, ValidationError

from d9dfn.config._base import ConfigError

__all__ = ["config_value", "describe_validation_error", "load_config"]

ConfigT = TypeVar("ConfigT", bound=BaseModel)

# --- Loading ------------------------------------------------------------------------------------------------


def load_config(
    cls: type[ConfigT], path: Path | str | None = None, overrides: Sequence[str] = (), *, default: ConfigT | None = None
) -> ConfigT:
    """Read a config of type ``cls`` from ``path`` (JSON, or YAML if PyYAML is installed), apply overrides.

    Args:
        cls: the config model, e.g. :class:`TrainerConfig`.
        path: a ``.json`` / ``.yaml`` / ``.yml`` file; ``None`` starts from ``default`` (or from no keys).
        overrides: ``"a.b.c=value"`` strings applied in order; ``value`` is parsed as JSON (``3``, ``1e-4``,
            ``true``, ``null``, ``{"name": "sgd", "lr": 0.1}``), and taken as a plain string if that fails.
            List items are addressed by index (``lr_scheduler.scheduler.phases.0.steps=10``).
        default: the config used when ``path`` is ``None`` (e.g. the CLI's embedded default job). The result's
            ``model_fields_set`` (pydantic's: which fields were given rather than defaulted) holds, section by
            section, the fields ``default`` set explicitly and those the overrides reach, as it would for a file
            (``model.source`` tells a ``--set model.hidden_size`` from the default by it).

    Raises:
        ConfigError: a missing or unreadable file, a malformed override, or a config that does not validate;
            the message lists every bad field by its dotted path, the problem and the fix.

    >>> from d9dfn.config import TrainerConfig
    >>> load_config(TrainerConfig, None, ["optimizer.name=sgd", "optimizer.lr=0.1"]).optimizer.lr
    0.1
    """
    data: Any = {} if default is None else default.model_dump(mode="json")
    where = ""
    if path is not None:
        path = Path(path)
        data = _read_file(path)
        where = f"{path}: "
        _check_depth(data, where)
    data = copy.deepcopy(data)
    not_json: dict[str, str] = {}  # override key -> why its value is not JSON (it was taken as a string)
    for override in overrides:
        _apply_override(data, override, not_json)
    try:
        config = cls.model_validate(data)
    except ValidationError as error:
        raise ConfigError(f"load_config: {where}{describe_validation_error(cls, error, not_json)}") from None
    if path is None and default is not None:  # every field came in the default's dump: set, to pydantic
        given = [tuple(override.partition("=")[0].strip().split(".")) for override in overrides]
        _keep_given(config, default, (), given)
    return config


def config_value(path: Path | str | None, overrides: Sequence[str], key: str) -> Any:
    """The top-level ``key`` of the config that ``path`` and ``overrides`` make, before any validation (``None`` when
    absent): what picks the config model to validate it with (the CLI's ``"job"``).

    Raises:
        ConfigError: as :func:`load_config`, for an unreadable file or a malformed override.

    >>> config_value(None, ["job=classification", "trainer.total_steps=3"], "job")
    'classification'
    """
    data: Any = {} if path is None else _read_file(Path(path))
    # Only ``key``'s subtree is copied, and only the overrides under ``key`` applied: the rest may be deep (the whole
    # config's depth is checked, with its path, when it is loaded), and deep-copying it would overflow the stack.
    top = {key: copy.deepcopy(data.get(key))} if isinstance(data, dict) and key in data else {}
    for override in overrides:
        if override.partition("=")[0].strip().split(".")[0] == key:
            _apply_override(top, override, {})
        elif "=" not in override:
            _apply_override({}, override, {})  # malformed: its one line, as load_config gives it
    return top.get(key)


def _keep_given(node: BaseModel, default: Any, path: tuple[str, ...], given: Sequence[tuple[str, ...]]) -> None:
    """Narrow ``node``'s (at ``path``) and its sections' ``model_fields_set`` to the fields ``default`` (the same
    section of the default config) set explicitly and those an override in ``given`` reaches. A section an
    override replaced whole was validated from the override alone: pydantic's own set is right there."""
    kept: set[str] = set()
    for name in node.model_fields_set:
        here = (*path, name)
        replaced = any(here[: len(key)] == key for key in given)
        reached = replaced or any(key[: len(here)] == here for key in given)
        if reached or (isinstance(default, BaseModel) and name in default.model_fields_set):
            kept.add(name)
        if replaced:
            continue
        value, theirs = getattr(node, name), getattr(default, name, None)
        if isinstance(value, BaseModel):
            _keep_given(value, theirs if type(theirs) is type(value) else None, here, given)
        elif isinstance(value, list | tuple):
            for index, item in enumerate(value):
                if isinstance(item, BaseModel):
                    mine = theirs[index] if isinstance(theirs, list | tuple) and index < len(theirs) else None
                    _keep_given(item, mine if type(mine) is type(item) else None, (*here, str(index)), given)
    object.__setattr__(node, "__pydantic_fields_set__", kept)  # frozen models: pydantic's own slot


def describe_validation_error(
    cls: type[BaseModel], error: ValidationError, not_json: Mapping[str, str] | None = None
) -> str:
    """``error`` (from validating ``cls``) as one line: each bad field's dotted path, the problem and the fix.

    Several errors are joined by `` | ``, after their count; pydantic's own rendering takes three lines per error.
    ``not_json`` maps the dotted key of an override whose value was not JSON (so it was read as a string) to
    the JSON error, which is added to that key's problem.

    >>> from d9dfn.config import TrainerConfig
    >>> try:
    ...     TrainerConfig.model_validate({"optimizer": {"name": "sgd", "lr": -1}})
    ... except ValidationError as error:
    ...     print(describe_validation_error(TrainerConfig, error))
    optimizer.lr=-1: Input should be greater than 0; fix it in the config or with --set optimizer.lr=VALUE
    """
    errors = error.errors(include_url=False)
    # A list whose items failed also reports "too short" (it counts the valid items): noise.
    errors = [
        err
        for err in errors
        if err["type"] != "too_short"
        or not any(other["loc"][: len(err["loc"])] == err["loc"] and other is not err for other in errors)
    ]
    problems: list[list[str]] = []  # [where, problem, fix]
    for err in errors:
        where, problem, fix = _describe_error(cls, err, not_json or {})
        same = next((p for p in problems if fix and p[0] == where and p[2] == fix), None)
        if same is not None:  # a plain union's members each refused the value: one problem, their options
            same[1] += f", or {problem.removeprefix('Input should be ')}"
        else:
            problems.append([where, problem, fix])
    lines = [f"{where}: {problem}{fix}" for where, problem, fix in problems]
    return lines[0] if len(lines) == 1 else f"{len(lines)} problems: " + " | ".join(lines)


def _read_file(path: Path) -> dict[str, Any]:
    """The config file's top-level object; a ``ConfigError`` naming the file and the fix for anything else."""
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except ValueError:  # os.stat refuses a path holding a NUL character ("embedded null byte")
        raise ConfigError(
            f"load_config: config file {str(path)!r} is not a path: it holds a NUL character (\\0); pass the path "
            "of a JSON or YAML file"
        ) from None
    if not exists or is_dir:
        what = "is a directory" if is_dir else "does not exist"
        raise ConfigError(f"load_config: config file {str(path)!r} {what}; pass the path of a JSON or YAML file")
    # Any file that reads (a pipe such as bash's <(...) too), not only a regular one.
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"load_config: config file {str(path)!r} is not UTF-8 text (byte 0x{error.object[error.start]:02x} at "
            f"offset {error.start}); pass a JSON or YAML file"
        ) from None
    except OSError as error:
        raise ConfigError(
            f"load_config: config file {str(path)!r} cannot be read ({type(error).__name__}: "
            f"{error.strerror or error}); make it readable or pass another file"
        ) from None
    if not text.strip():
        raise ConfigError(
            f"load_config: config file {str(path)!r} is empty; pass a JSON or YAML file whose top level is an object "
            'of sections such as {"trainer": {...}}'
        )
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(
                f"load_config: {str(path)!r} is YAML but PyYAML is not installed; `pip install pyyaml` or convert "
                f"the file to JSON"
            ) from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ConfigError(f"load_config: {str(path)!r} is not valid YAML: {error}; fix the syntax") from None
        except RecursionError:
            raise ConfigError(_too_deep(repr(str(path)))) from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(
                f"load_config: {str(path)!r} is not valid JSON: {error.msg} at line {error.lineno}, column "
                f"{error.colno}; fix the syntax there"
            ) from None
        except RecursionError:
            raise ConfigError(_too_deep(repr(str(path)))) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"load_config: {str(path)!r} holds a {type(data).__name__}, not an object; the top level must be "
            f'an object of sections such as {{"optimizer": {{...}}}}'
        )
    return data


MAX_DEPTH = 64
"""How deeply a config may nest lists and objects: d9dfn's own settings nest a few levels, free-form JSON
(``run.hparams``) has room; a deeper document is refused in one line before copying or validating it (both recurse,
and Python's recursion limit would end them with a traceback)."""


def _too_deep(what: str, levels: str = "") -> str:
    levels = levels or f"more than Python's parser takes (about {sys.getrecursionlimit()})"
    return (
        f"load_config: {what} nests lists and objects {levels} levels deep; a config may nest {MAX_DEPTH} at most: "
        "flatten that value"
    )


def _check_depth(value: Any, where: str, prefix: Sequence[str] = ()) -> None:
    """Refuse ``value`` if it nests lists and objects more than :data:`MAX_DEPTH` levels (an iterative walk: no
    recursion); the message names the key path down to that depth."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, tuple(prefix))]
    while stack:
        node, path = stack.pop()
        if len(path) - len(prefix) > MAX_DEPTH:
            shown = ".".join(path[: len(prefix) + 4]) + ".(...)"
            raise ConfigError(_too_deep(f"{where}{shown}", f"more than {MAX_DEPTH}"))
        if isinstance(node, dict):
            stack.extend((child, (*path, str(key))) for key, child in node.items())
        elif isinstance(node, list):
            stack.extend((child, (*path, str(index))) for index, child in enumerate(node))


def _apply_override(data: dict[str, Any], override: str, not_json: dict[str, str]) -> None:
    """Set ``a.b.c=value`` in ``data`` (our own fresh copy), creating missing objects on the way.

    A value that is not JSON is taken as a string; when it looks like a JSON object or list, why it is not JSON
    goes into ``not_json`` under the key.
    """
    key, sep, raw = override.partition("=")
    segments = key.strip().split(".")
    if not sep or not all(segments):
        raise ConfigError(
            f"load_config: override {override!r} is not of the form a.b.c=value; write e.g. batching.microbatch_size=4"
        )
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ConfigError(_too_deep(f"override {key.strip()!r}")) from None
    except json.JSONDecodeError as error:
        value = raw
        if raw.lstrip()[:1] in ("{", "["):  # meant as an object or a list, e.g. with its quotes lost to a shell
            not_json[".".join(segments)] = f"{error.msg} at character {error.pos + 1}"
    _check_depth(value, "override ", segments)
    node: Any = data
    for depth, segment in enumerate(segments):
        where = ".".join(segments[:depth]) or "the top level"
        index: str | int = segment  # a dict key, or a list index
        if isinstance(node, list):
            if not segment.isdigit() or int(segment) >= len(node):
                raise ConfigError(
                    f"load_config: override {override!r}: {where} is a list of {len(node)} item(s) and "
                    f"{segment!r} is not an index into it; use an index from 0 to {len(node) - 1}"
                )
            index = int(segment)
        elif not isinstance(node, dict):
            raise ConfigError(
                f"load_config: override {override!r}: {where} is {node!r}, not an object; set the whole value "
                f"instead, e.g. {where}={{...}}"
            )
        if depth == len(segments) - 1:
            node[index] = value
        else:
            if isinstance(node, dict) and node.get(index) is None:
                node[index] = {}  # a missing or null section: start it empty, its defaults fill the rest
            node = node[index]


def _strip_annotated(annotation: Any) -> Any:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _union_members(annotation: Any) -> tuple[Any, ...]:
    annotation = _strip_annotated(annotation)
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(_strip_annotated(a) for a in get_args(annotation) if a is not type(None))
    return (annotation,)


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _tagged_member(members: tuple[Any, ...], segment: Any) -> Any:
    """The member of a discriminated union whose tag (a ``Literal`` field's value) is ``segment``."""
    for member in members:
        if _is_model(member):
            for field in member.model_fields.values():
                if get_origin(field.annotation) is Literal and segment in get_args(field.annotation):
                    return member
    return None


def _pydantic_tag_member(annotation: Any, segment: Any) -> Any:
    """The member of a union with a callable discriminator whose ``pydantic.Tag`` is ``segment`` (``LMJobConfig.data``:
    ``Annotated[CorpusConfig, Tag("corpus")] | Annotated[FilesConfig, Tag("files")]``), else ``None``."""
    from pydantic import Tag

    annotation = _strip_annotated(annotation)
    if get_origin(annotation) not in (Union, types.UnionType):
        return None
    for member in get_args(annotation):
        if get_origin(member) is Annotated and any(
            isinstance(meta, Tag) and meta.tag == segment for meta in member.__metadata__
        ):
            return _strip_annotated(member)
    return None


def _tags(annotation: Any) -> list[str]:
    """The tags of a discriminated union's members (every ``Literal`` value of their fields)."""
    return [
        str(tag)
        for member in _union_members(annotation)
        if _is_model(member)
        for field in member.model_fields.values()
        if get_origin(field.annotation) is Literal
        for tag in get_args(field.annotation)
    ]


_JSON_ITEM = object()
"""``_locate``'s mark for "a key or index inside a ``JsonValue`` list or dict comes next"."""


def _locate(cls: type[BaseModel], loc: tuple[Any, ...]) -> tuple[list[str], type[BaseModel] | None, Any]:
    """Turn a pydantic error location into the user's dotted key path (union tags and labels dropped).

    Returns the path, the model whose field the last segment names (for "allowed keys" hints), and the
    annotation found at the path (``None`` past the schema).
    """
    path: list[str] = []
    node: Any = cls
    owner: type[BaseModel] | None = None
    after_tag = False  # a tag is followed by a key (a key may happen to equal the tag)
    for segment in loc:
        owner = None
        if node is None:
            path.append(str(segment))
            continue
        if node is JsonValue:  # pydantic labels the member JSON type at each level: `list`, then the index
            node = _JSON_ITEM if segment in ("list", "dict") else None
            continue
        if node is _JSON_ITEM:
            node = JsonValue
            path.append(str(segment))
            continue
        members = _union_members(node)
        tagged = _tagged_member(members, segment) or _pydantic_tag_member(node, segment)
        if not after_tag and (len(members) > 1 or (tagged is not None and segment not in tagged.model_fields)):
            # A discriminated union's tag, or a plain union's member label: not a key the user wrote.
            node, after_tag = tagged, True
            continue
        after_tag = False
        node = members[0]
        origin = get_origin(node)
        if _is_model(node):
            owner = node
            field = node.model_fields.get(segment)
            node = field.annotation if field is not None else None
        elif origin in (tuple, list) and isinstance(segment, int):
            args = get_args(node)
            if origin is list or (len(args) == 2 and args[1] is Ellipsis):
                node = args[0]
            else:
                node = args[segment] if segment < len(args) else None
        elif origin is dict:
            node = get_args(node)[1]
        else:
            node = None
        path.append(str(segment))
    return path, owner, node


# Errors whose message shows the value and says the fix (d9dfn's own); pydantic's other types get both added.
_OWN_MESSAGES = ("value_error", "assertion_error", "strict_scalar", "device")


def _describe_error(cls: type[BaseModel], err: Any, not_json: Mapping[str, str]) -> tuple[str, str, str]:
    """``(where, problem, fix)``: ``where`` is the dotted path (``path=value`` for pydantic's own checks, whose
    message does not show the value), ``fix`` is ``"; fix it ..."`` for those and empty where ``problem`` says it."""
    path_segments, owner, node = _locate(cls, tuple(err["loc"]))
    path = ".".join(path_segments) or "<top level>"
    kind = err["type"]
    if kind == "extra_forbidden":
        allowed = sorted(owner.model_fields) if owner is not None else []
        close = difflib.get_close_matches(path_segments[-1], allowed, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        problem = f"unknown key; {hint}allowed keys here: {', '.join(allowed)}; remove or rename it"
        if owner is not None and _is_tagged(owner):
            # Often a leftover of another kind after `section.name=other`: the whole section must change.
            parent = ".".join(path_segments[:-1])
            problem += f" (to switch kinds, replace the whole section: {parent}={{...}})"
        return path, problem, ""
    if kind == "missing":
        field = owner.model_fields.get(path_segments[-1]) if owner is not None else None
        about = ""
        if field is not None and field.description:
            about = f" ({_one_line(field.description.replace('``', '')).rstrip('.')})"
        return path, f"required but missing{about}; add it to the config or set it with --set {path}=VALUE", ""
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        key = str(err.get("ctx", {}).get("discriminator", "")).strip("'")
        options = ", ".join(repr(tag) for tag in _tags(node))
        got = f"{key}={err['input'].get(key)!r} is not a known kind" if kind == "union_tag_invalid" else f"no {key!r}"
        return path, f"{got}; set {path}.{key} to one of {options}", ""
    if kind == "finite_number":
        problem = (
            f"{err['input']!r} is not a finite number (JSON's Infinity, NaN and an overflowing literal such as 1e400 "
            f"read as one); write a finite number in the config or with --set {path}=VALUE"
        )
        return path, problem, ""
    message = _one_line(err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, "))
    if kind in _OWN_MESSAGES:
        return path, message, ""
    shown = repr(err.get("input"))
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    if path in not_json and isinstance(err.get("input"), str):
        # e.g. `--set trainer.pipelining={schedule: ...}`: JSON wants double-quoted keys, and a shell eats quotes.
        message += (
            f" (the value was read as a string: it is not JSON, {not_json[path]}; quote keys and strings with "
            "double quotes and the whole --set argument with single quotes)"
        )
    return f"{path}={shown}", message, f"; fix it in the config or with --set {path}=VALUE"


def _is_tagged(model: type[BaseModel]) -> bool:
    """Whether ``model`` is a member of a discriminated union: a field whose type is a one-value ``Literal``."""
    return any(
        get_origin(field.annotation) is Literal and len(get_args(field.annotation)) == 1
        for field in model.model_fields.values()
    )


def _one_line(text: str) -> str:
    """``text`` with its line breaks and runs of spaces made single spaces (an error is one line)."""
    return " ".join(text.split())
