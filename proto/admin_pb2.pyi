from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class AdminCall(_message.Message):
    __slots__ = ("action", "arguments", "app_bundle")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    APP_BUNDLE_FIELD_NUMBER: _ClassVar[int]
    action: str
    arguments: bytes
    app_bundle: bytes
    def __init__(self, action: _Optional[str] = ..., arguments: _Optional[bytes] = ..., app_bundle: _Optional[bytes] = ...) -> None: ...

class AdminResult(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: bytes
    def __init__(self, result: _Optional[bytes] = ...) -> None: ...

class ExportRequest(_message.Message):
    __slots__ = ("run_id", "data")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    run_id: int
    data: str
    def __init__(self, run_id: _Optional[int] = ..., data: _Optional[str] = ...) -> None: ...

class ExportPiece(_message.Message):
    __slots__ = ("path", "data", "kind")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    path: str
    data: bytes
    kind: str
    def __init__(self, path: _Optional[str] = ..., data: _Optional[bytes] = ..., kind: _Optional[str] = ...) -> None: ...
