"""Every error the server returns has OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

A bad request is a 400 (FastAPI's own 422 for a body that does not validate included), a missing or
wrong API key a 401, an unknown model a 404; the server keeps serving after each. A request the engine
cannot finish because its process died is a 503 (code "engine_dead"); the server then exits."""
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from nanovllm.async_llm import EngineDeadError
from nanovllm.entrypoints.protocol import ErrorInfo, ErrorResponse


class APIError(Exception):
    """Raised anywhere in a request's handling; answered with its status and OpenAI's error shape."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info()).model_dump(), status_code=self.status)


def as_api_error(error: Exception) -> APIError:
    """Any error as the API tells it: a refusal (ValueError, TypeError) is the client's 400, the engine's
    death a 503, anything else a 500."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, (ValueError, TypeError)):
        return APIError(str(error))
    if isinstance(error, EngineDeadError):     # its first line: the engine's traceback is for the server's log
        return APIError(str(error).splitlines()[0], status=503, type="server_error", code="engine_dead")
    return APIError(f"internal server error: {type(error).__name__}: {error}", status=500, type="server_error")


def _validation_error(errors: list[dict]) -> APIError:
    """The first problem pydantic found, worded for a person, with the field it concerns as `param`."""
    error = errors[0]
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    kind, message = error.get("type", ""), str(error.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")
    if kind == "json_invalid":
        reason = (error.get("ctx") or {}).get("error", "")
        return APIError(f"the request body is not valid JSON{': ' + reason if reason else ''}")
    if not loc:
        if kind == "missing":
            return APIError("the request needs a JSON body")
        if kind in ("model_type", "model_attributes_type", "dict_type"):
            return APIError("the request body must be a JSON object")
        return APIError(message)
    param = ".".join(loc)
    return APIError(f"{param}: {message}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
        return _validation_error(list(error.errors())).response()

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, error: EngineDeadError) -> JSONResponse:
        return as_api_error(error).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        # Starlette's own answers: an unknown path (404), a wrong method (405)
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return APIError(str(error.detail), status=error.status_code, type=kind).response()

    @app.exception_handler(Exception)
    async def server_error(request: Request, error: Exception) -> JSONResponse:
        # the traceback is logged by the server (Starlette raises the error again after this answer)
        return as_api_error(error).response()
