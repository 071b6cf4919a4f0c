from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_BOTH: _ClassVar[Role]

class Path(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PATH_AUTO: _ClassVar[Path]
    PATH_BOUNCE: _ClassVar[Path]
    PATH_STANDARD: _ClassVar[Path]

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    OUTCOME_SUCCESS: _ClassVar[Outcome]
    OUTCOME_FAILURE: _ClassVar[Outcome]
    OUTCOME_TIMEOUT: _ClassVar[Outcome]
    OUTCOME_CANCELLED: _ClassVar[Outcome]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_BOTH: Role
PATH_AUTO: Path
PATH_BOUNCE: Path
PATH_STANDARD: Path
OUTCOME_UNSPECIFIED: Outcome
OUTCOME_SUCCESS: Outcome
OUTCOME_FAILURE: Outcome
OUTCOME_TIMEOUT: Outcome
OUTCOME_CANCELLED: Outcome

class KvLayout(_message.Message):
    __slots__ = ("layers", "num_blocks", "block_bytes", "kv_split", "dtype", "tp_rank", "tp_size", "block_tokens", "kv_heads", "head_dim", "device", "device_uuid")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_SPLIT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    layers: int
    num_blocks: int
    block_bytes: int
    kv_split: bool
    dtype: str
    tp_rank: int
    tp_size: int
    block_tokens: int
    kv_heads: int
    head_dim: int
    device: int
    device_uuid: str
    def __init__(self, layers: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., kv_split: bool = ..., dtype: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., block_tokens: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., device: _Optional[int] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("engine_id", "pod_uid", "role", "layout")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    POD_UID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    pod_uid: str
    role: Role
    layout: KvLayout
    def __init__(self, engine_id: _Optional[str] = ..., pod_uid: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("attached", "heartbeat", "closing")
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    CLOSING_FIELD_NUMBER: _ClassVar[int]
    attached: Attached
    heartbeat: Heartbeat
    closing: Closing
    def __init__(self, attached: _Optional[_Union[Attached, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., closing: _Optional[_Union[Closing, _Mapping]] = ...) -> None: ...

class Attached(_message.Message):
    __slots__ = ("session", "agent", "layout_fingerprint", "incarnation")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    session: str
    agent: str
    layout_fingerprint: str
    incarnation: int
    def __init__(self, session: _Optional[str] = ..., agent: _Optional[str] = ..., layout_fingerprint: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Closing(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("session", "shm", "cuda_ipc")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    session: str
    shm: ShmPool
    cuda_ipc: CudaIpcPool
    def __init__(self, session: _Optional[str] = ..., shm: _Optional[_Union[ShmPool, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcPool, _Mapping]] = ...) -> None: ...

class ShmPool(_message.Message):
    __slots__ = ("name", "len")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    len: int
    def __init__(self, name: _Optional[str] = ..., len: _Optional[int] = ...) -> None: ...

class CudaIpcPool(_message.Message):
    __slots__ = ("handle", "offset", "len")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LEN_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    offset: int
    len: int
    def __init__(self, handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., len: _Optional[int] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("len",)
    LEN_FIELD_NUMBER: _ClassVar[int]
    len: int
    def __init__(self, len: _Optional[int] = ...) -> None: ...

class BlockList(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Extent(_message.Message):
    __slots__ = ("src_offset", "dst_offset", "len")
    SRC_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    LEN_FIELD_NUMBER: _ClassVar[int]
    src_offset: int
    dst_offset: int
    len: int
    def __init__(self, src_offset: _Optional[int] = ..., dst_offset: _Optional[int] = ..., len: _Optional[int] = ...) -> None: ...

class ExtentList(_message.Message):
    __slots__ = ("extents",)
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    extents: _containers.RepeatedCompositeFieldContainer[Extent]
    def __init__(self, extents: _Optional[_Iterable[_Union[Extent, _Mapping]]] = ...) -> None: ...

class TransferRequest(_message.Message):
    __slots__ = ("session", "request_id", "dst_engine", "src_blocks", "dst_blocks", "extents", "path", "timeout_ms", "traceparent", "dst_incarnation")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DST_ENGINE_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EXTENTS_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    DST_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    session: str
    request_id: int
    dst_engine: str
    src_blocks: _containers.RepeatedScalarFieldContainer[int]
    dst_blocks: _containers.RepeatedScalarFieldContainer[int]
    extents: ExtentList
    path: Path
    timeout_ms: int
    traceparent: str
    dst_incarnation: int
    def __init__(self, session: _Optional[str] = ..., request_id: _Optional[int] = ..., dst_engine: _Optional[str] = ..., src_blocks: _Optional[_Iterable[int]] = ..., dst_blocks: _Optional[_Iterable[int]] = ..., extents: _Optional[_Union[ExtentList, _Mapping]] = ..., path: _Optional[_Union[Path, str]] = ..., timeout_ms: _Optional[int] = ..., traceparent: _Optional[str] = ..., dst_incarnation: _Optional[int] = ...) -> None: ...

class TransferResponse(_message.Message):
    __slots__ = ("outcome", "reason", "path", "bytes", "descriptors", "submit_us", "transfer_us")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_US_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_US_FIELD_NUMBER: _ClassVar[int]
    outcome: Outcome
    reason: str
    path: str
    bytes: int
    descriptors: int
    submit_us: int
    transfer_us: int
    def __init__(self, outcome: _Optional[_Union[Outcome, str]] = ..., reason: _Optional[str] = ..., path: _Optional[str] = ..., bytes: _Optional[int] = ..., descriptors: _Optional[int] = ..., submit_us: _Optional[int] = ..., transfer_us: _Optional[int] = ...) -> None: ...

class AwaitArrivalRequest(_message.Message):
    __slots__ = ("session", "request_id", "src_engine", "timeout_ms")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_ENGINE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    session: str
    request_id: int
    src_engine: str
    timeout_ms: int
    def __init__(self, session: _Optional[str] = ..., request_id: _Optional[int] = ..., src_engine: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class AwaitArrivalResponse(_message.Message):
    __slots__ = ("outcome", "reason", "src_engine", "bytes")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SRC_ENGINE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    outcome: Outcome
    reason: str
    src_engine: str
    bytes: int
    def __init__(self, outcome: _Optional[_Union[Outcome, str]] = ..., reason: _Optional[str] = ..., src_engine: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("session", "request_id")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    session: str
    request_id: int
    def __init__(self, session: _Optional[str] = ..., request_id: _Optional[int] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: bool = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class InFlight(_message.Message):
    __slots__ = ("request_id", "dst_engine", "path", "bytes", "age_us")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DST_ENGINE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    AGE_US_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    dst_engine: str
    path: str
    bytes: int
    age_us: int
    def __init__(self, request_id: _Optional[int] = ..., dst_engine: _Optional[str] = ..., path: _Optional[str] = ..., bytes: _Optional[int] = ..., age_us: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("engine_id", "in_flight", "transfers_succeeded", "transfers_failed", "bytes_sent", "arrivals", "pool_len")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FAILED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    ARRIVALS_FIELD_NUMBER: _ClassVar[int]
    POOL_LEN_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    in_flight: _containers.RepeatedCompositeFieldContainer[InFlight]
    transfers_succeeded: int
    transfers_failed: int
    bytes_sent: int
    arrivals: int
    pool_len: int
    def __init__(self, engine_id: _Optional[str] = ..., in_flight: _Optional[_Iterable[_Union[InFlight, _Mapping]]] = ..., transfers_succeeded: _Optional[int] = ..., transfers_failed: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., arrivals: _Optional[int] = ..., pool_len: _Optional[int] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class DetachResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
