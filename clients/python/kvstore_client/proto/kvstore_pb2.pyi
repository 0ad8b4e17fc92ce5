from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    INVALID_ARGUMENT: _ClassVar[ErrorCode]
    NAMESPACE_NOT_FOUND: _ClassVar[ErrorCode]
    PAGE_SIZE_MISMATCH: _ClassVar[ErrorCode]
    LEASE_NOT_FOUND: _ClassVar[ErrorCode]
    CHECKSUM_MISMATCH: _ClassVar[ErrorCode]
    DUPLICATE_KEY: _ClassVar[ErrorCode]
    BATCH_TOO_LARGE: _ClassVar[ErrorCode]
    CAPACITY_EXHAUSTED: _ClassVar[ErrorCode]
    DRAINING: _ClassVar[ErrorCode]
    PERMISSION_DENIED: _ClassVar[ErrorCode]
    MALFORMED_REQUEST: _ClassVar[ErrorCode]
    INTERNAL: _ClassVar[ErrorCode]
    TOKEN_MISMATCH: _ClassVar[ErrorCode]
    SLOT_NOT_IN_LEASE: _ClassVar[ErrorCode]
    LENGTH_MISMATCH: _ClassVar[ErrorCode]
    SLOT_BUSY: _ClassVar[ErrorCode]
    TRANSPORT_UNAVAILABLE: _ClassVar[ErrorCode]
    UNAUTHENTICATED: _ClassVar[ErrorCode]
    GROUP_INCOMPLETE: _ClassVar[ErrorCode]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    HBM: _ClassVar[Tier]
    DRAM: _ClassVar[Tier]
    NVME: _ClassVar[Tier]
    REMOTE: _ClassVar[Tier]
    ENGINE: _ClassVar[Tier]

class ReserveState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESERVED: _ClassVar[ReserveState]
    PRESENT: _ClassVar[ReserveState]
    IN_FLIGHT: _ClassVar[ReserveState]
    PARENT_MISSING: _ClassVar[ReserveState]
    NO_SPACE: _ClassVar[ReserveState]

class PrefetchPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WAIT_COMPLETE: _ClassVar[PrefetchPolicy]
    BEST_EFFORT: _ClassVar[PrefetchPolicy]
    TIMEOUT: _ClassVar[PrefetchPolicy]

class CommitState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMMITTED: _ClassVar[CommitState]
    COMMIT_PARENT_MISSING: _ClassVar[CommitState]

class GroupHitPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GROUP_ALL_PAGES: _ClassVar[GroupHitPolicy]
    GROUP_TRAILING_PAGES: _ClassVar[GroupHitPolicy]
ERROR_CODE_UNSPECIFIED: ErrorCode
INVALID_ARGUMENT: ErrorCode
NAMESPACE_NOT_FOUND: ErrorCode
PAGE_SIZE_MISMATCH: ErrorCode
LEASE_NOT_FOUND: ErrorCode
CHECKSUM_MISMATCH: ErrorCode
DUPLICATE_KEY: ErrorCode
BATCH_TOO_LARGE: ErrorCode
CAPACITY_EXHAUSTED: ErrorCode
DRAINING: ErrorCode
PERMISSION_DENIED: ErrorCode
MALFORMED_REQUEST: ErrorCode
INTERNAL: ErrorCode
TOKEN_MISMATCH: ErrorCode
SLOT_NOT_IN_LEASE: ErrorCode
LENGTH_MISMATCH: ErrorCode
SLOT_BUSY: ErrorCode
TRANSPORT_UNAVAILABLE: ErrorCode
UNAUTHENTICATED: ErrorCode
GROUP_INCOMPLETE: ErrorCode
TIER_UNSPECIFIED: Tier
HBM: Tier
DRAM: Tier
NVME: Tier
REMOTE: Tier
ENGINE: Tier
RESERVED: ReserveState
PRESENT: ReserveState
IN_FLIGHT: ReserveState
PARENT_MISSING: ReserveState
NO_SPACE: ReserveState
WAIT_COMPLETE: PrefetchPolicy
BEST_EFFORT: PrefetchPolicy
TIMEOUT: PrefetchPolicy
COMMITTED: CommitState
COMMIT_PARENT_MISSING: CommitState
GROUP_ALL_PAGES: GroupHitPolicy
GROUP_TRAILING_PAGES: GroupHitPolicy

class NamespaceSpec(_message.Message):
    __slots__ = ("model", "tenant", "kv_dtype", "num_layers", "num_kv_heads", "head_dim", "page_tokens", "tp_rank", "tp_size", "layout", "page_bytes", "hash_seed")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    model: str
    tenant: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_tokens: int
    tp_rank: int
    tp_size: int
    layout: str
    page_bytes: int
    hash_seed: str
    def __init__(self, model: _Optional[str] = ..., tenant: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., page_tokens: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., layout: _Optional[str] = ..., page_bytes: _Optional[int] = ..., hash_seed: _Optional[str] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("batch_pages_max", "page_bytes_max", "key_bytes_max", "read_lease_ttl_ms", "write_lease_ttl_ms", "frame_bytes_max", "lookup_pages_max", "lookup_keys_packed", "lookup_hex_digests", "pages_packed", "commit_copied_by_node")
    BATCH_PAGES_MAX_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_MAX_FIELD_NUMBER: _ClassVar[int]
    KEY_BYTES_MAX_FIELD_NUMBER: _ClassVar[int]
    READ_LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    WRITE_LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    FRAME_BYTES_MAX_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_PAGES_MAX_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_KEYS_PACKED_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_HEX_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    PAGES_PACKED_FIELD_NUMBER: _ClassVar[int]
    COMMIT_COPIED_BY_NODE_FIELD_NUMBER: _ClassVar[int]
    batch_pages_max: int
    page_bytes_max: int
    key_bytes_max: int
    read_lease_ttl_ms: int
    write_lease_ttl_ms: int
    frame_bytes_max: int
    lookup_pages_max: int
    lookup_keys_packed: bool
    lookup_hex_digests: bool
    pages_packed: bool
    commit_copied_by_node: bool
    def __init__(self, batch_pages_max: _Optional[int] = ..., page_bytes_max: _Optional[int] = ..., key_bytes_max: _Optional[int] = ..., read_lease_ttl_ms: _Optional[int] = ..., write_lease_ttl_ms: _Optional[int] = ..., frame_bytes_max: _Optional[int] = ..., lookup_pages_max: _Optional[int] = ..., lookup_keys_packed: _Optional[bool] = ..., lookup_hex_digests: _Optional[bool] = ..., pages_packed: _Optional[bool] = ..., commit_copied_by_node: _Optional[bool] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ("client_name",)
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    def __init__(self, client_name: _Optional[str] = ...) -> None: ...

class HelloResponse(_message.Message):
    __slots__ = ("server_version", "shm_socket", "arena_bytes", "limits", "tcp_endpoint", "rdma_enabled", "instance_id", "hbm", "data_ticket", "tcp_tls", "local_challenge", "local_answer", "tcp_calls")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHM_SOCKET_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    TCP_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    RDMA_ENABLED_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    HBM_FIELD_NUMBER: _ClassVar[int]
    DATA_TICKET_FIELD_NUMBER: _ClassVar[int]
    TCP_TLS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ANSWER_FIELD_NUMBER: _ClassVar[int]
    TCP_CALLS_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    shm_socket: str
    arena_bytes: int
    limits: Limits
    tcp_endpoint: str
    rdma_enabled: bool
    instance_id: bytes
    hbm: HbmRegion
    data_ticket: bytes
    tcp_tls: bool
    local_challenge: bytes
    local_answer: bytes
    tcp_calls: bool
    def __init__(self, server_version: _Optional[str] = ..., shm_socket: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., tcp_endpoint: _Optional[str] = ..., rdma_enabled: _Optional[bool] = ..., instance_id: _Optional[bytes] = ..., hbm: _Optional[_Union[HbmRegion, _Mapping]] = ..., data_ticket: _Optional[bytes] = ..., tcp_tls: _Optional[bool] = ..., local_challenge: _Optional[bytes] = ..., local_answer: _Optional[bytes] = ..., tcp_calls: _Optional[bool] = ...) -> None: ...

class HbmRegion(_message.Message):
    __slots__ = ("ipc_handle", "nbytes", "device_uuid")
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    ipc_handle: bytes
    nbytes: int
    device_uuid: bytes
    def __init__(self, ipc_handle: _Optional[bytes] = ..., nbytes: _Optional[int] = ..., device_uuid: _Optional[bytes] = ...) -> None: ...

class OpenNamespaceRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: NamespaceSpec
    def __init__(self, spec: _Optional[_Union[NamespaceSpec, _Mapping]] = ...) -> None: ...

class OpenNamespaceResponse(_message.Message):
    __slots__ = ("namespace_id",)
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    def __init__(self, namespace_id: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "tokens", "parent_key", "keys_packed", "key_bytes", "each_key", "engine_ids", "load_rates", "hex_digests")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    KEYS_PACKED_FIELD_NUMBER: _ClassVar[int]
    KEY_BYTES_FIELD_NUMBER: _ClassVar[int]
    EACH_KEY_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_RATES_FIELD_NUMBER: _ClassVar[int]
    HEX_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    parent_key: bytes
    keys_packed: bytes
    key_bytes: int
    each_key: bool
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    load_rates: bool
    hex_digests: bool
    def __init__(self, namespace_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., tokens: _Optional[_Iterable[int]] = ..., parent_key: _Optional[bytes] = ..., keys_packed: _Optional[bytes] = ..., key_bytes: _Optional[int] = ..., each_key: _Optional[bool] = ..., engine_ids: _Optional[_Iterable[str]] = ..., load_rates: _Optional[bool] = ..., hex_digests: _Optional[bool] = ...) -> None: ...

class TierRate(_message.Message):
    __slots__ = ("tier", "seconds_per_page", "pages")
    TIER_FIELD_NUMBER: _ClassVar[int]
    SECONDS_PER_PAGE_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    seconds_per_page: float
    pages: float
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., seconds_per_page: _Optional[float] = ..., pages: _Optional[float] = ...) -> None: ...

class EnginePrefix(_message.Message):
    __slots__ = ("engine_id", "gpu_pages", "held_pages")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    GPU_PAGES_FIELD_NUMBER: _ClassVar[int]
    HELD_PAGES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    gpu_pages: int
    held_pages: int
    def __init__(self, engine_id: _Optional[str] = ..., gpu_pages: _Optional[int] = ..., held_pages: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hit_pages", "tiers", "last_key", "tiers_packed", "held", "engines", "load_rates")
    HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LAST_KEY_FIELD_NUMBER: _ClassVar[int]
    TIERS_PACKED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    LOAD_RATES_FIELD_NUMBER: _ClassVar[int]
    hit_pages: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    last_key: bytes
    tiers_packed: bytes
    held: bytes
    engines: _containers.RepeatedCompositeFieldContainer[EnginePrefix]
    load_rates: _containers.RepeatedCompositeFieldContainer[TierRate]
    def __init__(self, hit_pages: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., last_key: _Optional[bytes] = ..., tiers_packed: _Optional[bytes] = ..., held: _Optional[bytes] = ..., engines: _Optional[_Iterable[_Union[EnginePrefix, _Mapping]]] = ..., load_rates: _Optional[_Iterable[_Union[TierRate, _Mapping]]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("namespace_id", "parent_key", "keys", "page_bytes", "lease_ttl_ms", "lease_id", "rdma_qp_num", "anchor_absent_parent", "parent_keys", "packed_answer")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    RDMA_QP_NUM_FIELD_NUMBER: _ClassVar[int]
    ANCHOR_ABSENT_PARENT_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEYS_FIELD_NUMBER: _ClassVar[int]
    PACKED_ANSWER_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    parent_key: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    page_bytes: int
    lease_ttl_ms: int
    lease_id: int
    rdma_qp_num: int
    anchor_absent_parent: bool
    parent_keys: _containers.RepeatedScalarFieldContainer[bytes]
    packed_answer: bool
    def __init__(self, namespace_id: _Optional[int] = ..., parent_key: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., page_bytes: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ..., lease_id: _Optional[int] = ..., rdma_qp_num: _Optional[int] = ..., anchor_absent_parent: _Optional[bool] = ..., parent_keys: _Optional[_Iterable[bytes]] = ..., packed_answer: _Optional[bool] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("lease_id", "states", "offsets", "lease_ttl_ms", "first_index", "data_token", "no_space_reason", "states_packed", "offsets_packed")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NO_SPACE_REASON_FIELD_NUMBER: _ClassVar[int]
    STATES_PACKED_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_PACKED_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    states: _containers.RepeatedScalarFieldContainer[ReserveState]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    lease_ttl_ms: int
    first_index: int
    data_token: bytes
    no_space_reason: str
    states_packed: bytes
    offsets_packed: bytes
    def __init__(self, lease_id: _Optional[int] = ..., states: _Optional[_Iterable[_Union[ReserveState, str]]] = ..., offsets: _Optional[_Iterable[int]] = ..., lease_ttl_ms: _Optional[int] = ..., first_index: _Optional[int] = ..., data_token: _Optional[bytes] = ..., no_space_reason: _Optional[str] = ..., states_packed: _Optional[bytes] = ..., offsets_packed: _Optional[bytes] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("lease_id", "indices", "checksums", "durable", "checksums_from_writer", "first_index", "index_count", "checksums_packed", "packed_answer", "copied_by_node")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FROM_WRITER_FIELD_NUMBER: _ClassVar[int]
    FIRST_INDEX_FIELD_NUMBER: _ClassVar[int]
    INDEX_COUNT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_PACKED_FIELD_NUMBER: _ClassVar[int]
    PACKED_ANSWER_FIELD_NUMBER: _ClassVar[int]
    COPIED_BY_NODE_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    indices: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    durable: bool
    checksums_from_writer: bool
    first_index: int
    index_count: int
    checksums_packed: bytes
    packed_answer: bool
    copied_by_node: bytes
    def __init__(self, lease_id: _Optional[int] = ..., indices: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., durable: _Optional[bool] = ..., checksums_from_writer: _Optional[bool] = ..., first_index: _Optional[int] = ..., index_count: _Optional[int] = ..., checksums_packed: _Optional[bytes] = ..., packed_answer: _Optional[bool] = ..., copied_by_node: _Optional[bytes] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("states", "checksums", "durable_pages", "states_packed", "checksums_packed")
    STATES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    STATES_PACKED_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_PACKED_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[CommitState]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    durable_pages: int
    states_packed: bytes
    checksums_packed: bytes
    def __init__(self, states: _Optional[_Iterable[_Union[CommitState, str]]] = ..., checksums: _Optional[_Iterable[int]] = ..., durable_pages: _Optional[int] = ..., states_packed: _Optional[bytes] = ..., checksums_packed: _Optional[bytes] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    def __init__(self, lease_id: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_pages",)
    ABORTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    aborted_pages: int
    def __init__(self, aborted_pages: _Optional[int] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "lease_ttl_ms", "policy", "timeout_ms", "rdma_qp_num", "wait_ms", "hbm_reader", "packed_answer")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    RDMA_QP_NUM_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    HBM_READER_FIELD_NUMBER: _ClassVar[int]
    PACKED_ANSWER_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ttl_ms: int
    policy: PrefetchPolicy
    timeout_ms: int
    rdma_qp_num: int
    wait_ms: int
    hbm_reader: bool
    packed_answer: bool
    def __init__(self, namespace_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., lease_ttl_ms: _Optional[int] = ..., policy: _Optional[_Union[PrefetchPolicy, str]] = ..., timeout_ms: _Optional[int] = ..., rdma_qp_num: _Optional[int] = ..., wait_ms: _Optional[int] = ..., hbm_reader: _Optional[bool] = ..., packed_answer: _Optional[bool] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease_id", "hit_pages", "offsets", "checksums", "offsets_packed", "checksums_packed", "page_bytes", "lease_ttl_ms", "promoted_pages", "data_token", "hbm_offsets", "hot_pages")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_PACKED_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_PACKED_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DATA_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HBM_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    HOT_PAGES_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    hit_pages: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    offsets_packed: bytes
    checksums_packed: bytes
    page_bytes: int
    lease_ttl_ms: int
    promoted_pages: int
    data_token: bytes
    hbm_offsets: _containers.RepeatedScalarFieldContainer[int]
    hot_pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[int] = ..., hit_pages: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., checksums: _Optional[_Iterable[int]] = ..., offsets_packed: _Optional[bytes] = ..., checksums_packed: _Optional[bytes] = ..., page_bytes: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ..., promoted_pages: _Optional[int] = ..., data_token: _Optional[bytes] = ..., hbm_offsets: _Optional[_Iterable[int]] = ..., hot_pages: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_ids", "changed_pages")
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    CHANGED_PAGES_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    changed_pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_ids: _Optional[_Iterable[int]] = ..., changed_pages: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "all_pages", "report_keys")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ALL_PAGES_FIELD_NUMBER: _ClassVar[int]
    REPORT_KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    all_pages: bool
    report_keys: bool
    def __init__(self, namespace_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., all_pages: _Optional[bool] = ..., report_keys: _Optional[bool] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted_pages", "removed_keys", "removed_keys_cut")
    DELETED_PAGES_FIELD_NUMBER: _ClassVar[int]
    REMOVED_KEYS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_KEYS_CUT_FIELD_NUMBER: _ClassVar[int]
    deleted_pages: int
    removed_keys: _containers.RepeatedScalarFieldContainer[bytes]
    removed_keys_cut: bool
    def __init__(self, deleted_pages: _Optional[int] = ..., removed_keys: _Optional[_Iterable[bytes]] = ..., removed_keys_cut: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("namespaces_offset", "namespaces_max")
    NAMESPACES_OFFSET_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_MAX_FIELD_NUMBER: _ClassVar[int]
    namespaces_offset: int
    namespaces_max: int
    def __init__(self, namespaces_offset: _Optional[int] = ..., namespaces_max: _Optional[int] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_bytes", "used_bytes", "pages", "hits", "misses", "evictions", "promotions", "demotions", "bytes_in", "bytes_out", "corrupt_pages")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_PAGES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_bytes: int
    used_bytes: int
    pages: int
    hits: int
    misses: int
    evictions: int
    promotions: int
    demotions: int
    bytes_in: int
    bytes_out: int
    corrupt_pages: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., pages: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., promotions: _Optional[int] = ..., demotions: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., corrupt_pages: _Optional[int] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace_id", "model", "tenant", "page_bytes", "pages", "spec")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    model: str
    tenant: str
    page_bytes: int
    pages: int
    spec: NamespaceSpec
    def __init__(self, namespace_id: _Optional[int] = ..., model: _Optional[str] = ..., tenant: _Optional[str] = ..., page_bytes: _Optional[int] = ..., pages: _Optional[int] = ..., spec: _Optional[_Union[NamespaceSpec, _Mapping]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "namespaces", "leases_open", "leases_expired", "pages_committed", "checksum_failures", "write_queue_drops", "recovered_pages", "nvme_write_errors", "namespaces_total", "scrub_pages_checked", "scrub_pages_bad", "scrub_passes", "engines", "tenants", "nvme_quarantined")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    LEASES_OPEN_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    PAGES_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    WRITE_QUEUE_DROPS_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NVME_WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SCRUB_PAGES_CHECKED_FIELD_NUMBER: _ClassVar[int]
    SCRUB_PAGES_BAD_FIELD_NUMBER: _ClassVar[int]
    SCRUB_PASSES_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    NVME_QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    leases_open: int
    leases_expired: int
    pages_committed: int
    checksum_failures: int
    write_queue_drops: int
    recovered_pages: int
    nvme_write_errors: int
    namespaces_total: int
    scrub_pages_checked: int
    scrub_pages_bad: int
    scrub_passes: int
    engines: _containers.RepeatedCompositeFieldContainer[EngineStats]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    nvme_quarantined: _containers.RepeatedCompositeFieldContainer[QuarantinedShard]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., leases_open: _Optional[int] = ..., leases_expired: _Optional[int] = ..., pages_committed: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., write_queue_drops: _Optional[int] = ..., recovered_pages: _Optional[int] = ..., nvme_write_errors: _Optional[int] = ..., namespaces_total: _Optional[int] = ..., scrub_pages_checked: _Optional[int] = ..., scrub_pages_bad: _Optional[int] = ..., scrub_passes: _Optional[int] = ..., engines: _Optional[_Iterable[_Union[EngineStats, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., nvme_quarantined: _Optional[_Iterable[_Union[QuarantinedShard, _Mapping]]] = ...) -> None: ...

class QuarantinedShard(_message.Message):
    __slots__ = ("shard", "path", "moved_to", "cause", "at_start")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MOVED_TO_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    AT_START_FIELD_NUMBER: _ClassVar[int]
    shard: int
    path: str
    moved_to: str
    cause: str
    at_start: bool
    def __init__(self, shard: _Optional[int] = ..., path: _Optional[str] = ..., moved_to: _Optional[str] = ..., cause: _Optional[str] = ..., at_start: _Optional[bool] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "dram_bytes", "dram_pages", "nvme_bytes", "nvme_pages", "dram_quota_bytes", "nvme_quota_bytes", "evictions", "nvme_evictions", "dram_refused_pages", "nvme_refused_pages")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DRAM_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NVME_BYTES_FIELD_NUMBER: _ClassVar[int]
    NVME_PAGES_FIELD_NUMBER: _ClassVar[int]
    DRAM_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    NVME_QUOTA_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NVME_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DRAM_REFUSED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NVME_REFUSED_PAGES_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    dram_bytes: int
    dram_pages: int
    nvme_bytes: int
    nvme_pages: int
    dram_quota_bytes: int
    nvme_quota_bytes: int
    evictions: int
    nvme_evictions: int
    dram_refused_pages: int
    nvme_refused_pages: int
    def __init__(self, tenant: _Optional[str] = ..., dram_bytes: _Optional[int] = ..., dram_pages: _Optional[int] = ..., nvme_bytes: _Optional[int] = ..., nvme_pages: _Optional[int] = ..., dram_quota_bytes: _Optional[int] = ..., nvme_quota_bytes: _Optional[int] = ..., evictions: _Optional[int] = ..., nvme_evictions: _Optional[int] = ..., dram_refused_pages: _Optional[int] = ..., nvme_refused_pages: _Optional[int] = ...) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("engine_id", "pages", "blocks_seen", "blocks_stored", "blocks_removed", "blocks_unattributable", "blocks_not_in_memory", "blocks_dropped", "batches", "batches_missed", "block_tokens", "blocks_refused")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SEEN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_UNATTRIBUTABLE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_NOT_IN_MEMORY_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_MISSED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    pages: int
    blocks_seen: int
    blocks_stored: int
    blocks_removed: int
    blocks_unattributable: int
    blocks_not_in_memory: int
    blocks_dropped: int
    batches: int
    batches_missed: int
    block_tokens: int
    blocks_refused: int
    def __init__(self, engine_id: _Optional[str] = ..., pages: _Optional[int] = ..., blocks_seen: _Optional[int] = ..., blocks_stored: _Optional[int] = ..., blocks_removed: _Optional[int] = ..., blocks_unattributable: _Optional[int] = ..., blocks_not_in_memory: _Optional[int] = ..., blocks_dropped: _Optional[int] = ..., batches: _Optional[int] = ..., batches_missed: _Optional[int] = ..., block_tokens: _Optional[int] = ..., blocks_refused: _Optional[int] = ...) -> None: ...

class ScrubRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ScrubResponse(_message.Message):
    __slots__ = ("pages_checked", "pages_bad")
    PAGES_CHECKED_FIELD_NUMBER: _ClassVar[int]
    PAGES_BAD_FIELD_NUMBER: _ClassVar[int]
    pages_checked: int
    pages_bad: int
    def __init__(self, pages_checked: _Optional[int] = ..., pages_bad: _Optional[int] = ...) -> None: ...

class ListKeysRequest(_message.Message):
    __slots__ = ("namespace_id", "keys_max", "cursor")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_MAX_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    keys_max: int
    cursor: int
    def __init__(self, namespace_id: _Optional[int] = ..., keys_max: _Optional[int] = ..., cursor: _Optional[int] = ...) -> None: ...

class ListKeysResponse(_message.Message):
    __slots__ = ("keys", "more", "cursor")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    more: bool
    cursor: int
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., more: _Optional[bool] = ..., cursor: _Optional[int] = ...) -> None: ...

class ListPagesRequest(_message.Message):
    __slots__ = ("namespace_id", "pages_max", "cursor")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    PAGES_MAX_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    pages_max: int
    cursor: int
    def __init__(self, namespace_id: _Optional[int] = ..., pages_max: _Optional[int] = ..., cursor: _Optional[int] = ...) -> None: ...

class PageTiers(_message.Message):
    __slots__ = ("key", "parent_key", "dram", "nvme")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    DRAM_FIELD_NUMBER: _ClassVar[int]
    NVME_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent_key: bytes
    dram: bool
    nvme: bool
    def __init__(self, key: _Optional[bytes] = ..., parent_key: _Optional[bytes] = ..., dram: _Optional[bool] = ..., nvme: _Optional[bool] = ...) -> None: ...

class ListPagesResponse(_message.Message):
    __slots__ = ("pages", "more", "cursor", "events_seq", "events_topic", "events_enabled", "events_run")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    EVENTS_SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_TOPIC_FIELD_NUMBER: _ClassVar[int]
    EVENTS_ENABLED_FIELD_NUMBER: _ClassVar[int]
    EVENTS_RUN_FIELD_NUMBER: _ClassVar[int]
    pages: _containers.RepeatedCompositeFieldContainer[PageTiers]
    more: bool
    cursor: int
    events_seq: int
    events_topic: bytes
    events_enabled: bool
    events_run: bytes
    def __init__(self, pages: _Optional[_Iterable[_Union[PageTiers, _Mapping]]] = ..., more: _Optional[bool] = ..., cursor: _Optional[int] = ..., events_seq: _Optional[int] = ..., events_topic: _Optional[bytes] = ..., events_enabled: _Optional[bool] = ..., events_run: _Optional[bytes] = ...) -> None: ...

class RdmaQueuePair(_message.Message):
    __slots__ = ("lid", "gid", "qp_num", "psn", "mtu", "gid_type")
    LID_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    QP_NUM_FIELD_NUMBER: _ClassVar[int]
    PSN_FIELD_NUMBER: _ClassVar[int]
    MTU_FIELD_NUMBER: _ClassVar[int]
    GID_TYPE_FIELD_NUMBER: _ClassVar[int]
    lid: int
    gid: bytes
    qp_num: int
    psn: int
    mtu: int
    gid_type: str
    def __init__(self, lid: _Optional[int] = ..., gid: _Optional[bytes] = ..., qp_num: _Optional[int] = ..., psn: _Optional[int] = ..., mtu: _Optional[int] = ..., gid_type: _Optional[str] = ...) -> None: ...

class RdmaConnectRequest(_message.Message):
    __slots__ = ("queue_pair",)
    QUEUE_PAIR_FIELD_NUMBER: _ClassVar[int]
    queue_pair: RdmaQueuePair
    def __init__(self, queue_pair: _Optional[_Union[RdmaQueuePair, _Mapping]] = ...) -> None: ...

class RdmaConnectResponse(_message.Message):
    __slots__ = ("queue_pair", "arena_addr", "rkey", "arena_bytes")
    QUEUE_PAIR_FIELD_NUMBER: _ClassVar[int]
    ARENA_ADDR_FIELD_NUMBER: _ClassVar[int]
    RKEY_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    queue_pair: RdmaQueuePair
    arena_addr: int
    rkey: int
    arena_bytes: int
    def __init__(self, queue_pair: _Optional[_Union[RdmaQueuePair, _Mapping]] = ..., arena_addr: _Optional[int] = ..., rkey: _Optional[int] = ..., arena_bytes: _Optional[int] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "tokens", "engine_ids")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., tokens: _Optional[_Iterable[int]] = ..., engine_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineScore(_message.Message):
    __slots__ = ("engine_id", "score", "prefix_pages", "engine_gpu_pages", "engine_host_pages", "dram_pages", "nvme_pages")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PAGES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_GPU_PAGES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_HOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    DRAM_PAGES_FIELD_NUMBER: _ClassVar[int]
    NVME_PAGES_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    score: float
    prefix_pages: int
    engine_gpu_pages: int
    engine_host_pages: int
    dram_pages: int
    nvme_pages: int
    def __init__(self, engine_id: _Optional[str] = ..., score: _Optional[float] = ..., prefix_pages: _Optional[int] = ..., engine_gpu_pages: _Optional[int] = ..., engine_host_pages: _Optional[int] = ..., dram_pages: _Optional[int] = ..., nvme_pages: _Optional[int] = ...) -> None: ...

class RouteResponse(_message.Message):
    __slots__ = ("scores", "best_engine_id")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    BEST_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[EngineScore]
    best_engine_id: str
    def __init__(self, scores: _Optional[_Iterable[_Union[EngineScore, _Mapping]]] = ..., best_engine_id: _Optional[str] = ...) -> None: ...

class RdmaDisconnectRequest(_message.Message):
    __slots__ = ("qp_num",)
    QP_NUM_FIELD_NUMBER: _ClassVar[int]
    qp_num: int
    def __init__(self, qp_num: _Optional[int] = ...) -> None: ...

class RdmaDisconnectResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CommitGroupRequest(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[CommitRequest]
    def __init__(self, parts: _Optional[_Iterable[_Union[CommitRequest, _Mapping]]] = ...) -> None: ...

class CommitGroupResponse(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[CommitResponse]
    def __init__(self, parts: _Optional[_Iterable[_Union[CommitResponse, _Mapping]]] = ...) -> None: ...

class GroupPart(_message.Message):
    __slots__ = ("namespace_id", "hit_policy", "trailing_pages")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    HIT_POLICY_FIELD_NUMBER: _ClassVar[int]
    TRAILING_PAGES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: int
    hit_policy: GroupHitPolicy
    trailing_pages: int
    def __init__(self, namespace_id: _Optional[int] = ..., hit_policy: _Optional[_Union[GroupHitPolicy, str]] = ..., trailing_pages: _Optional[int] = ...) -> None: ...

class LookupGroupRequest(_message.Message):
    __slots__ = ("keys", "parts")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    parts: _containers.RepeatedCompositeFieldContainer[GroupPart]
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., parts: _Optional[_Iterable[_Union[GroupPart, _Mapping]]] = ...) -> None: ...

class LookupGroupResponse(_message.Message):
    __slots__ = ("hit_pages", "part_hit_pages", "restorable_pages")
    HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    PART_HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    RESTORABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    hit_pages: int
    part_hit_pages: _containers.RepeatedScalarFieldContainer[int]
    restorable_pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, hit_pages: _Optional[int] = ..., part_hit_pages: _Optional[_Iterable[int]] = ..., restorable_pages: _Optional[_Iterable[int]] = ...) -> None: ...

class AcquireGroupRequest(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[AcquireRequest]
    def __init__(self, parts: _Optional[_Iterable[_Union[AcquireRequest, _Mapping]]] = ...) -> None: ...

class AcquireGroupResponse(_message.Message):
    __slots__ = ("parts",)
    PARTS_FIELD_NUMBER: _ClassVar[int]
    parts: _containers.RepeatedCompositeFieldContainer[AcquireResponse]
    def __init__(self, parts: _Optional[_Iterable[_Union[AcquireResponse, _Mapping]]] = ...) -> None: ...
