"""The ways to call /pause, read from the server's /openapi.json, never assumed.

The styles are the ``mode`` query parameter's enum (FastAPI writes it inline,
through ``$ref`` or inside ``anyOf`` for an Optional) plus any deprecated boolean
flag that selects a mode on older vLLM. ``read_pause_api`` parses a document;
``discover_pause_api`` asks a server; ``pause_capabilities`` is the run report's
summary of the same parse (harness/pytest/report.py), which never raises.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Iterable

from harness.pause import PauseCheckFailure, failure

if TYPE_CHECKING:
    from harness.vllm.client import ServerClient

PAUSE_ROUTES = ("/pause", "/resume", "/is_paused")
# What each documented mode does to in-flight requests (vLLM's /pause docstring).
DOCUMENTED: dict[str, str] = {"abort": "aborted", "wait": "drained", "keep": "frozen"}
# Deprecated boolean flags that select a mode (older vLLM): name -> class.
LEGACY_FLAGS: dict[str, str] = {"wait_for_inflight_requests": "drained"}


@dataclasses.dataclass(frozen=True)
class PauseStyle:
    """One way to call /pause: a mode (or a legacy flag) and its query parameters."""

    name: str
    params: tuple[tuple[str, str], ...]
    expect: str | None  # documented class of in-flight requests, None if undocumented

    def pause(self, client: "ServerClient", timeout: float | None = None, *,
              confirm: bool = True) -> Any:
        return client.pause(timeout=timeout, confirm=confirm, **dict(self.params))

    def __str__(self) -> str:
        return self.name


@dataclasses.dataclass
class PauseAPI:
    modes: list[str]                 # the ``mode`` enum; [] when there is no mode parameter
    default_mode: str | None
    params: dict[str, dict]          # every query parameter of POST /pause -> its schema
    routes: list[str]

    @property
    def bool_params(self) -> list[str]:
        return [n for n, s in self.params.items() if "boolean" in _types(s)]

    @property
    def legacy_flags(self) -> list[str]:
        return [n for n in LEGACY_FLAGS if n in self.params]

    def styles(self) -> list[PauseStyle]:
        out = [PauseStyle(m, (("mode", m),), DOCUMENTED.get(m)) for m in self.modes]
        if "mode" not in self.params:
            out.append(PauseStyle("default", (), None))
        for flag in self.legacy_flags:
            out.append(PauseStyle(flag, ((flag, "true"),), LEGACY_FLAGS[flag]))
        return out

    def style(self, name: str) -> PauseStyle | None:
        return next((s for s in self.styles() if s.name == name), None)

    def as_dict(self) -> dict:
        return {"modes": self.modes, "default_mode": self.default_mode,
                "params": {n: sorted(_types(s)) for n, s in self.params.items()},
                "styles": [s.name for s in self.styles()],
                "routes": [r for r in self.routes if r in PAUSE_ROUTES]}


# ----------------------------------------------------------------------------- schemas

def _deref(spec: dict, obj: Any) -> Any:
    """``obj`` with its ``$ref`` followed; keys written next to a ``$ref`` (FastAPI puts
    a parameter's ``default`` there) win over the referenced schema's."""
    seen, siblings = 0, {}
    while isinstance(obj, dict) and "$ref" in obj and seen < 20:
        for k, v in obj.items():
            if k != "$ref":
                siblings.setdefault(k, v)
        node: Any = spec
        for part in obj["$ref"].lstrip("#/").split("/"):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        obj, seen = node, seen + 1
    return {**obj, **siblings} if siblings and isinstance(obj, dict) else obj


def _resolve(spec: dict, schema: Any) -> dict:
    """A schema with every $ref and every anyOf/oneOf/allOf branch inlined."""
    schema = _deref(spec, schema)
    if not isinstance(schema, dict):
        return {}
    out = {k: v for k, v in schema.items() if k not in ("anyOf", "oneOf", "allOf")}
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            out[key] = [_resolve(spec, s) for s in schema[key]]
    return out


def _branches(schema: dict) -> Iterable[dict]:
    yield schema
    for key in ("anyOf", "oneOf", "allOf"):
        for s in schema.get(key, []):
            yield from _branches(s)


def _types(schema: dict) -> set[str]:
    return {b["type"] for b in _branches(schema) if isinstance(b.get("type"), str)}


def _enum(schema: dict) -> list[str]:
    vals: list[str] = []
    for b in _branches(schema):
        for v in b.get("enum", []) + ([b["const"]] if "const" in b else []):
            if isinstance(v, str) and v not in vals:
                vals.append(v)
    return vals


def _pause_operation(spec: dict) -> dict | None:
    return ((spec.get("paths") or {}).get("/pause") or {}).get("post")


def _query_params(spec: dict, op: dict) -> dict[str, dict]:
    params: dict[str, dict] = {}
    for p in op.get("parameters") or []:
        p = _deref(spec, p)
        if isinstance(p, dict) and p.get("in") == "query" and p.get("name"):
            params[p["name"]] = _resolve(spec, p.get("schema", {}))
    return params


# ----------------------------------------------------------------------------- readers

def read_pause_api(spec: dict) -> PauseAPI:
    """POST /pause's query parameters (and the ``mode`` enum) from an OpenAPI document.
    Raises ``PauseCheckFailure`` when a pause route is missing or ``mode`` has no enum."""
    paths = spec.get("paths") or {}
    missing = [r for r in PAUSE_ROUTES if r not in paths]
    if missing:
        raise failure(f"routes {missing} are not in the server's /openapi.json; it has "
                      f"{sorted(paths)}")
    op = _pause_operation(spec)
    if op is None:
        raise failure(f"/pause has no POST operation in /openapi.json: {paths['/pause']}")
    params = _query_params(spec, op)
    mode = params.get("mode")
    modes = _enum(mode) if mode else []
    if mode is not None and not modes:
        raise failure(f"/pause takes a 'mode' parameter but /openapi.json gives no enum for "
                      f"it: {mode}")
    return PauseAPI(modes, mode.get("default") if mode else None, params, sorted(paths))


def discover_pause_api(client: "ServerClient") -> PauseAPI:
    """``read_pause_api`` of the server's own /openapi.json; a failure carries the
    server's context."""
    try:
        return read_pause_api(client.openapi())
    except PauseCheckFailure as e:
        raise failure(str(e), client) from None


def pause_capabilities(spec: dict) -> dict:
    """For the run report: whether POST /pause exists, its ``mode`` values and default,
    and its query parameters. Never raises: a server without /pause is a fact to
    report, not an error."""
    op = _pause_operation(spec)
    if op is None:
        return {"route": False, "modes": [], "default": None, "params": []}
    params = _query_params(spec, op)
    mode = params.get("mode")
    return {"route": True, "modes": _enum(mode) if mode else [],
            "default": mode.get("default") if mode else None, "params": sorted(params)}
