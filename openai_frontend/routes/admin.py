"""`GET /admin/traffic-splits`, `PUT` and `DELETE /admin/traffic-splits/{model}`: the version
splits in force (openai_frontend/traffic.py), changed at run time.

Every call needs the admin key (the frontend's `triton_admin_key`) in the `x-admin-key` header;
without an admin key configured the endpoints refuse every call. A change takes effect for the
next request routed (requests under way keep their version); it lasts until the next change, by
this endpoint or by a change of the split file.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any

from fastapi import APIRouter, Header
from pydantic import BaseModel

from openai_frontend.errors import APIError, invalid_request, model_not_found
from openai_frontend.state import State
from openai_frontend.traffic import SplitError, VersionSplit

router = APIRouter()

ADMIN_KEY_HEADER = "x-admin-key"


class SplitBody(BaseModel):
    weights: dict[str, int]
    """{version: percent}, summing to 100."""


def _authorize(state: State, given: str | None) -> None:
    key = state.config.triton_admin_key
    if not key:
        raise APIError(
            403,
            "the admin endpoints are disabled: start the frontend with an admin key "
            "(--triton-admin-key or $TRITON_ADMIN_KEY)",
            "permission_error",
        )
    if not given or not secrets.compare_digest(given.encode(), key.encode()):
        raise APIError(401, f"invalid or missing `{ADMIN_KEY_HEADER}`", "authentication_error")


AdminKey = Annotated[str | None, Header(alias=ADMIN_KEY_HEADER)]


@router.get("/admin/traffic-splits")
async def list_splits(state: State, x_admin_key: AdminKey = None) -> dict[str, Any]:
    _authorize(state, x_admin_key)
    # The split file may have changed since the last request routed: show what is in force now.
    state.registry.splits.reload_if_changed()
    state.registry.publish_splits()
    return {"splits": state.registry.splits.snapshot()}


@router.put("/admin/traffic-splits/{model}")
async def set_split(
    model: str, body: SplitBody, state: State, x_admin_key: AdminKey = None
) -> dict[str, Any]:
    """Set `model`'s split; every version it names must be READY now."""
    _authorize(state, x_admin_key)
    try:
        split = VersionSplit.parse(model, body.weights)
    except SplitError as exc:
        raise invalid_request(str(exc), "weights") from None
    await state.registry.refresh(force=True)
    ready = state.registry.ready_versions(model)
    if not ready:
        raise model_not_found(model)
    absent = [v for v in split.versions if v not in ready]
    if absent:
        raise invalid_request(
            f"model `{model}` serves no version {', '.join(absent)} (ready: {', '.join(ready)})",
            "weights",
        )
    state.registry.splits.set(model, split)
    state.registry.publish_splits()
    return {"model": model, "weights": split.as_dict()}


@router.delete("/admin/traffic-splits/{model}")
async def delete_split(model: str, state: State, x_admin_key: AdminKey = None) -> dict[str, Any]:
    """Remove `model`'s split: its plain name reaches the newest version again."""
    _authorize(state, x_admin_key)
    if not state.registry.splits.remove(model):
        raise APIError(404, f"model `{model}` has no traffic split", "not_found_error", "model")
    state.registry.publish_splits()
    return {"model": model, "deleted": True}
