from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorManifest(_message.Message):
    __slots__ = ("name", "dtype", "shape", "chunk_digests", "nbytes", "chunk_checksums")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    chunk_digests: _containers.RepeatedScalarFieldContainer[str]
    nbytes: int
    chunk_checksums: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., chunk_digests: _Optional[_Iterable[str]] = ..., nbytes: _Optional[int] = ..., chunk_checksums: _Optional[_Iterable[str]] = ...) -> None: ...

class RecordManifest(_message.Message):
    __slots__ = ("key", "tensors")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    key: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorManifest]
    def __init__(self, key: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorManifest, _Mapping]]] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("message_id", "reply_to_message_id", "message_type", "run_id", "round", "content", "arrays", "error_reason", "error_code", "metadata")
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_TYPE_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    ERROR_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    reply_to_message_id: str
    message_type: str
    run_id: int
    round: int
    content: bytes
    arrays: _containers.RepeatedCompositeFieldContainer[RecordManifest]
    error_reason: str
    error_code: int
    metadata: bytes
    def __init__(self, message_id: _Optional[str] = ..., reply_to_message_id: _Optional[str] = ..., message_type: _Optional[str] = ..., run_id: _Optional[int] = ..., round: _Optional[int] = ..., content: _Optional[bytes] = ..., arrays: _Optional[_Iterable[_Union[RecordManifest, _Mapping]]] = ..., error_reason: _Optional[str] = ..., error_code: _Optional[int] = ..., metadata: _Optional[bytes] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("digest", "data")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    digest: str
    data: bytes
    def __init__(self, digest: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("site_name", "node_id", "run_id", "run_config", "site_index", "app_bundle")
    SITE_NAME_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    SITE_INDEX_FIELD_NUMBER: _ClassVar[int]
    APP_BUNDLE_FIELD_NUMBER: _ClassVar[int]
    site_name: str
    node_id: int
    run_id: int
    run_config: bytes
    site_index: int
    app_bundle: bytes
    def __init__(self, site_name: _Optional[str] = ..., node_id: _Optional[int] = ..., run_id: _Optional[int] = ..., run_config: _Optional[bytes] = ..., site_index: _Optional[int] = ..., app_bundle: _Optional[bytes] = ...) -> None: ...

class PullMessageRequest(_message.Message):
    __slots__ = ("last_run_id", "wait_s")
    LAST_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    last_run_id: int
    wait_s: float
    def __init__(self, last_run_id: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class PullMessageReply(_message.Message):
    __slots__ = ("has_message", "envelope", "poll_after_s", "last_run_status", "chunks")
    HAS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    POLL_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    LAST_RUN_STATUS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    has_message: bool
    envelope: Envelope
    poll_after_s: float
    last_run_status: str
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    def __init__(self, has_message: bool = ..., envelope: _Optional[_Union[Envelope, _Mapping]] = ..., poll_after_s: _Optional[float] = ..., last_run_status: _Optional[str] = ..., chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ...) -> None: ...

class GetChunksRequest(_message.Message):
    __slots__ = ("digests",)
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    digests: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, digests: _Optional[_Iterable[str]] = ...) -> None: ...

class HasChunksRequest(_message.Message):
    __slots__ = ("digests",)
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    digests: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, digests: _Optional[_Iterable[str]] = ...) -> None: ...

class HasChunksReply(_message.Message):
    __slots__ = ("present",)
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    present: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, present: _Optional[_Iterable[str]] = ...) -> None: ...

class PutChunksReply(_message.Message):
    __slots__ = ("stored", "already_present")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    stored: int
    already_present: int
    def __init__(self, stored: _Optional[int] = ..., already_present: _Optional[int] = ...) -> None: ...

class PushReplyRequest(_message.Message):
    __slots__ = ("envelope", "chunks")
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    envelope: Envelope
    chunks: _containers.RepeatedCompositeFieldContainer[Chunk]
    def __init__(self, envelope: _Optional[_Union[Envelope, _Mapping]] = ..., chunks: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ...) -> None: ...

class PushReplyReply(_message.Message):
    __slots__ = ("duplicate",)
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    def __init__(self, duplicate: bool = ...) -> None: ...
