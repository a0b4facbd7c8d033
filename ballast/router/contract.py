"""The router's HTTP contract: every route's request and response schemas, served as
``GET /openapi.json`` and browsable at ``GET /docs``.

The handlers read their bodies themselves (bounded reads, errors naming the field,
OpenAI's error shape on the OpenAI routes), so FastAPI cannot infer their schemas;
``CONTRACT`` names them, one entry per route, and ``openapi_document`` puts them into
the document FastAPI generates from the route table. A route without an entry is an
error when the document is built (and in tests/unit/test_contract.py), so a new route
cannot ship without its contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from ballast.router import embeddings_api as ea
from ballast.router import openai_answers as answers
from ballast.router import openai_api as oa

VERSION = "0.1.0"


# --------------------------------------------------------------------------- answers


class NativeErrorDetail(BaseModel):
    code: str = Field(description="Ballast's stable error code, e.g. QUOTA_EXCEEDED.")
    message: str
    retry_after_s: float | None = Field(None, description="Also sent as the Retry-After header.")
    field: str | None = Field(None, description="The invalid field (INVALID_REQUEST).")


class NativeError(BaseModel):
    error: NativeErrorDetail


class GenerateAnswer(BaseModel):
    text: str
    tokens_generated: int
    model: str = Field(description="The model that answered (the fallback's name when it did).")
    criticality: str = Field(description="The class granted (a claim above the tenant's cap is lowered).")
    service_tier: str = Field(description="The tier that served it: default, flex or priority.")
    degradation_level: int
    degraded: bool
    degraded_reasons: list[str]
    max_tokens: int = Field(description="max_tokens after the level's clamp.")
    fallback: str | None = Field(description="null (the primary), fallback_model or cache.")


class GenerateEvent(BaseModel):
    """One server-sent event of a streamed /v1/generate: ``event: token`` data, or
    ``event: done`` (the fields of GenerateAnswer but text), or ``event: error``."""

    model_config = ConfigDict(extra="allow")
    text: str | None = None
    tokens: int | None = None


class Health(BaseModel):
    status: str
    levels: dict[str, int] | None = Field(None, description="Each model's level this router acts on.")


class ModelStatus(BaseModel):
    """One model as the answering router acts on it."""

    model_config = ConfigDict(extra="allow")
    level: int
    source: str = Field(description="snapshot, stale-snapshot or fail-static: where the level comes from.")


class Status(BaseModel):
    """``GET /v1/status``: per model (``models``: its level and where it comes from, breakers,
    retry budget, gate; ``snapshot.models``: the controller's state of it), replicas, kill
    switches, quotas, chaos, recycling, tenants in flight (docs/api.md)."""

    model_config = ConfigDict(extra="allow")
    models: dict[str, ModelStatus]


class AdminAnswer(BaseModel):
    """An admin route's answer (see docs/api.md)."""

    model_config = ConfigDict(extra="allow")


class KillSwitchEntry(BaseModel):
    id: str
    scope: str
    value: str | None
    reason: str
    set_by: str
    created_at_s: float
    expires_at_s: float


class AdapterEntry(BaseModel):
    """A LoRA adapter added at run time (``POST /admin/adapters``)."""

    model: str
    name: str
    path: str
    tenants: list[str] = Field(description='["*"]: every tenant the model admits.')
    added_at_s: float
    added_by: str = Field(description="The operator the call claimed (X-Ballast-Operator, unverified); empty: none.")


class Version(BaseModel):
    version: str = Field(description="Ballast's version (vLLM's /version answers the same way).")


class RecycleAccepted(BaseModel):
    accepted: list[str] = Field(description="The replicas marked for a recycle, in turn.")


class FileObject(BaseModel):
    """OpenAI's File object (ballast/batch/shapes.py)."""

    id: str
    object: str = "file"
    bytes: int
    created_at: int
    expires_at: int | None
    filename: str
    purpose: str = Field(description="batch (an upload) or batch_output (a batch's output or error file).")
    status: str
    status_details: str | None = None


class FileList(BaseModel):
    object: str = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: str = "file"
    deleted: bool


class FileUpload(BaseModel):
    """``POST /v1/files`` (multipart/form-data): the JSONL file, ``purpose`` "batch", and
    optionally ``expires_after[anchor]`` ("created_at") with ``expires_after[seconds]``."""

    file: bytes = Field(json_schema_extra={"format": "binary"})
    purpose: str = "batch"


class BatchObject(BaseModel):
    """OpenAI's Batch object (ballast/batch/shapes.py): its status, times, files and request counts."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: str = "batch"
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    request_counts: dict[str, int]


class BatchList(BaseModel):
    object: str = "list"
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseObject(BaseModel):
    """OpenAI's Response object (ballast/router/responses_items.py): its status, output items and usage."""

    model_config = ConfigDict(extra="allow")
    id: str
    object: str = "response"
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None


class ResponseEvent(BaseModel):
    """One Responses stream event (``event: <type>``): its type, its place in the stream, its fields."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


class ResponseDeleted(BaseModel):
    id: str
    object: str = "response.deleted"
    deleted: bool


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class RouteContract:
    response: Any  # a pydantic model (or a type TypeAdapter takes); None: no body
    request: type[BaseModel] | None = None
    stream: type[BaseModel] | None = None  # one text/event-stream event
    openai: bool = False  # errors in OpenAI's shape
    status: int = 200
    request_media: str = "application/json"
    response_media: str = "application/json"


def _contract() -> dict[tuple[str, str], RouteContract]:
    from ballast.router.admin import AdapterRequest, ChaosRequest, KillSwitchRequest, RecycleRequest
    from ballast.router.batches import BatchCreate
    from ballast.router.generate import GenerateRequest
    from ballast.router.responses_api import ResponsesRequest

    return {
        ("POST", "/v1/chat/completions"): RouteContract(
            answers.ChatCompletion, oa.ChatCompletionRequest, answers.ChatCompletionChunk, openai=True
        ),
        ("POST", "/v1/completions"): RouteContract(
            answers.Completion, oa.CompletionRequest, answers.Completion, openai=True
        ),
        ("POST", "/v1/embeddings"): RouteContract(ea.EmbeddingList, ea.EmbeddingRequest, openai=True),
        ("GET", "/v1/models"): RouteContract(answers.ModelList, openai=True),
        ("POST", "/v1/responses"): RouteContract(ResponseObject, ResponsesRequest, ResponseEvent, openai=True),
        ("GET", "/v1/responses/{response_id}"): RouteContract(ResponseObject, openai=True),
        ("DELETE", "/v1/responses/{response_id}"): RouteContract(ResponseDeleted, openai=True),
        ("POST", "/v1/generate"): RouteContract(GenerateAnswer, GenerateRequest, GenerateEvent),
        ("GET", "/v1/status"): RouteContract(Status),
        ("GET", "/healthz/live"): RouteContract(Health),
        ("GET", "/healthz/ready"): RouteContract(Health),
        ("GET", "/health"): RouteContract(None),
        ("GET", "/version"): RouteContract(Version),
        ("POST", "/admin/kill-switch"): RouteContract(KillSwitchEntry, KillSwitchRequest, status=201),
        ("GET", "/admin/kill-switch"): RouteContract(AdminAnswer),
        ("DELETE", "/admin/kill-switch/{entry_id}"): RouteContract(AdminAnswer),
        ("POST", "/admin/adapters"): RouteContract(AdapterEntry, AdapterRequest, status=201),
        ("GET", "/admin/adapters"): RouteContract(AdminAnswer),
        ("DELETE", "/admin/adapters/{name}"): RouteContract(AdminAnswer),
        ("POST", "/admin/chaos"): RouteContract(AdminAnswer, ChaosRequest),
        ("DELETE", "/admin/chaos"): RouteContract(AdminAnswer),
        ("POST", "/admin/recycle"): RouteContract(RecycleAccepted, RecycleRequest, status=202),
        ("GET", "/admin/replicas"): RouteContract(AdminAnswer),
        ("POST", "/v1/files"): RouteContract(FileObject, FileUpload, openai=True, request_media="multipart/form-data"),
        ("GET", "/v1/files"): RouteContract(FileList, openai=True),
        ("GET", "/v1/files/{file_id}"): RouteContract(FileObject, openai=True),
        ("DELETE", "/v1/files/{file_id}"): RouteContract(FileDeleted, openai=True),
        ("GET", "/v1/files/{file_id}/content"): RouteContract(
            bytes, openai=True, response_media="application/octet-stream"
        ),
        ("POST", "/v1/batches"): RouteContract(BatchObject, BatchCreate, openai=True),
        ("GET", "/v1/batches"): RouteContract(BatchList, openai=True),
        ("GET", "/v1/batches/{batch_id}"): RouteContract(BatchObject, openai=True),
        ("POST", "/v1/batches/{batch_id}/cancel"): RouteContract(BatchObject, openai=True),
        ("GET", "/admin/batches"): RouteContract(BatchList),
        ("GET", "/admin/dlq"): RouteContract(AdminAnswer),
        ("POST", "/admin/dlq/{dlq_id}/retry"): RouteContract(AdminAnswer),
        ("DELETE", "/admin/dlq/{dlq_id}"): RouteContract(AdminAnswer),
    }


class _Schemas:
    """Component schemas gathered while the document is built."""

    def __init__(self) -> None:
        self.components: dict[str, Any] = {}

    def ref(self, tp: Any) -> dict[str, Any]:
        schema = TypeAdapter(tp).json_schema(ref_template="#/components/schemas/{model}")
        self.components.update(schema.pop("$defs", {}))
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            self.components[tp.__name__] = schema
            return {"$ref": f"#/components/schemas/{tp.__name__}"}
        return schema


def openapi_document(routes: list[Any]) -> dict[str, Any]:
    """The OpenAPI document for ``routes`` (FastAPI's), with each route's contract in it."""
    doc = get_openapi(
        title="Ballast",
        version=VERSION,
        description="A self-protecting Ray Serve deployment for GPU models: an OpenAI-compatible "
        "API and a native one, with admission by criticality, quotas, fallbacks and deadlines. "
        "Every route needs Authorization: Bearer <key> (admin routes: the admin token).",
        routes=routes,
    )
    table = _contract()
    schemas = _Schemas()
    error_native, error_openai = schemas.ref(NativeError), schemas.ref(answers.ErrorResponse)
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            contract = table.get((method.upper(), path))
            if contract is None:
                raise ValueError(f"{method.upper()} {path}: no contract in ballast/router/contract.py")
            if contract.request is not None:
                op["requestBody"] = {
                    "required": True,
                    "content": {contract.request_media: {"schema": schemas.ref(contract.request)}},
                }
            content: dict[str, Any] = {}  # no body (GET /health)
            if contract.response is not None:
                content[contract.response_media] = {"schema": schemas.ref(contract.response)}
            if contract.stream is not None:
                content["text/event-stream"] = {"schema": schemas.ref(contract.stream)}
            params = [p for p in op.get("parameters", []) if p.get("in") == "path"]
            op["parameters"] = params  # FastAPI lists the handler's Request as nothing; keep path params only
            op["responses"] = {
                str(contract.status): {"description": "OK", "content": content},
                "default": {
                    "description": "An error: its status, Retry-After on 429/503",
                    "content": {"application/json": {"schema": error_openai if contract.openai else error_native}},
                },
            }
    doc.setdefault("components", {})["schemas"] = dict(sorted(schemas.components.items()))
    return doc
