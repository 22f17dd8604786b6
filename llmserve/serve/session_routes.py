"""DELETE /v1/sessions/{session_id}: free a session's KV now.

A session is opened implicitly: the first chat or text completion carrying `session_id` (an extra
body field, LMDeploy's name) that finishes keeps its KV, and the next request with that id prefills
only what it adds. The client still sends the whole history, so an unknown, evicted or closed
session only costs prefill, never correctness. Ids are compared as text: 5 and "5" are one session.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from llmserve.serve.errors import OpenAIError, error_response, error_responses
from llmserve.serve.state import ServerState

router = APIRouter(responses=error_responses(OpenAIError))


# :path, so an id containing "/" (accepted in a request body) can be closed too.
@router.delete("/v1/sessions/{session_id:path}")
async def close_session(session_id: str, request: Request) -> JSONResponse:
    state: ServerState = request.app.state.llm
    engine, _ = state.ready()
    closed, enabled = await engine.call(lambda e: (e.end_session(session_id), e.sessions.max_sessions > 0))
    if not closed and hasattr(engine, "end_session"):  # --dp: the session may live on another replica
        closed = await engine.end_session(session_id)
    if closed:
        return JSONResponse({"id": session_id, "object": "session", "deleted": True})
    # Returned, not raised: this is not a refused generation request, so it is not counted as one.
    if not enabled:
        message = ("sessions are off on this server (llmserve serve --max-sessions 0): no KV is kept between "
                   "turns, so there is nothing to close; start it with --max-sessions N (N > 0) to keep them")
    else:
        message = (f"session {session_id!r} does not exist: never used, already closed, or evicted (requests "
                   "with its id still work; they prefill the whole history)")
    return error_response(request.url.path, 404, message, "session_id", "session_not_found")
