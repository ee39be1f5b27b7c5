"""The control API as OpenAPI 3.1, from the same models that validate its requests
(``service.control``'s ``BeginBody`` and ``ReportBody``)."""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from rolloutcore.service.control import _INT63, LEASE_HEADER, BeginBody, ReportBody

__all__ = ["openapi_document"]


def openapi_document(title: str = "RolloutCore gateway: control API",
                     version: str = "1") -> dict[str, Any]:
    """The control API as OpenAPI 3.1, from the same models that validate requests."""
    _, defs = models_json_schema(
        [(m, "validation") for m in (BeginBody, ReportBody)],
        ref_template="#/components/schemas/{model}")
    schemas = defs.get("$defs", {})

    def ref(name: str) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{name}"}

    obj = {"type": "object"}

    def resp(*codes: int, ok: int = 200) -> dict[str, Any]:
        out: dict[str, Any] = {str(ok): {"description": "ok",
                                         "content": {"application/json": {"schema": obj}}}}
        for c in codes:
            out[str(c)] = {"description": _REASONS.get(c, "error"),
                           "content": {"application/json": {"schema": obj}}}
        return out

    auth_errors = (401, 403)
    uid = {"name": "update_id", "in": "path", "required": True,
           "schema": {"type": "integer", "minimum": 1, "maximum": _INT63}}
    lease = {"name": LEASE_HEADER, "in": "header", "required": True,
             "description": "the lease secret from the begin's answer (lease.secret)",
             "schema": {"type": "string", "maxLength": 256}}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": {
            "/control/updates": {"post": {
                "operationId": "beginUpdate",
                "summary": "Begin an update: check the expectations and the floor, drain, "
                           "quiesce, grant a lease (200: the same begin_key again)",
                "requestBody": {"required": True,
                                "content": {"application/json": {"schema": ref("BeginBody")}}},
                "responses": {**resp(400, *auth_errors, 409, 413, 415, 422, 503, ok=201),
                              "200": {"description": "the open grant of this begin_key",
                                      "content": {"application/json": {"schema": obj}}}},
            }},
            "/control/updates/{update_id}": {"get": {
                "operationId": "getUpdate",
                "summary": "An update's lease and result",
                "parameters": [uid, lease],
                "responses": resp(*auth_errors, 404),
            }},
            "/control/updates/{update_id}/transfer": {"post": {
                "operationId": "reportTransfer",
                "summary": "Report the transfer (evidence or failure); the service commits",
                "parameters": [uid, lease],
                "requestBody": {"required": True,
                                "content": {"application/json": {"schema": ref("ReportBody")}}},
                "responses": resp(400, *auth_errors, 404, 409, 410, 413, 415, 422),
            }},
            "/control/status": {"get": {
                "operationId": "status",
                "summary": "State, committed version and identity, rollouts, transitions",
                "responses": resp(*auth_errors),
            }},
        },
    }


_REASONS = {400: "malformed JSON", 401: "missing bearer token",
            403: "wrong token, or not this update's lease secret",
            404: "no such update", 409: "conflict (another update, or already reported)",
            410: "the lease expired", 413: "body too large", 415: "not JSON",
            422: "invalid fields, expectations, or below the verification floor",
            503: "the update could not begin"}
