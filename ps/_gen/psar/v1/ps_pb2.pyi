from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    SYNC: _ClassVar[Mode]
    ASYNC: _ClassVar[Mode]
    SSP: _ClassVar[Mode]
    LOCAL: _ClassVar[Mode]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
MODE_UNSPECIFIED: Mode
SYNC: Mode
ASYNC: Mode
SSP: Mode
LOCAL: Mode

class ModeTraits(_message.Message):
    __slots__ = ("rounds", "staleness", "between_steps", "shard_owns_loss_scale", "rejoin")
    class Staleness(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STALENESS_UNSPECIFIED: _ClassVar[ModeTraits.Staleness]
        NONE: _ClassVar[ModeTraits.Staleness]
        VERSIONS: _ClassVar[ModeTraits.Staleness]
        BOUNDED: _ClassVar[ModeTraits.Staleness]
    STALENESS_UNSPECIFIED: ModeTraits.Staleness
    NONE: ModeTraits.Staleness
    VERSIONS: ModeTraits.Staleness
    BOUNDED: ModeTraits.Staleness
    class BetweenSteps(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        BETWEEN_STEPS_UNSPECIFIED: _ClassVar[ModeTraits.BetweenSteps]
        PULL: _ClassVar[ModeTraits.BetweenSteps]
        LOCAL_STEPS: _ClassVar[ModeTraits.BetweenSteps]
    BETWEEN_STEPS_UNSPECIFIED: ModeTraits.BetweenSteps
    PULL: ModeTraits.BetweenSteps
    LOCAL_STEPS: ModeTraits.BetweenSteps
    class Rejoin(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REJOIN_UNSPECIFIED: _ClassVar[ModeTraits.Rejoin]
        AT_ROUND_BOUNDARY: _ClassVar[ModeTraits.Rejoin]
        AT_ONCE: _ClassVar[ModeTraits.Rejoin]
    REJOIN_UNSPECIFIED: ModeTraits.Rejoin
    AT_ROUND_BOUNDARY: ModeTraits.Rejoin
    AT_ONCE: ModeTraits.Rejoin
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    BETWEEN_STEPS_FIELD_NUMBER: _ClassVar[int]
    SHARD_OWNS_LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    REJOIN_FIELD_NUMBER: _ClassVar[int]
    rounds: bool
    staleness: ModeTraits.Staleness
    between_steps: ModeTraits.BetweenSteps
    shard_owns_loss_scale: bool
    rejoin: ModeTraits.Rejoin
    def __init__(self, rounds: _Optional[bool] = ..., staleness: _Optional[_Union[ModeTraits.Staleness, str]] = ..., between_steps: _Optional[_Union[ModeTraits.BetweenSteps, str]] = ..., shard_owns_loss_scale: _Optional[bool] = ..., rejoin: _Optional[_Union[ModeTraits.Rejoin, str]] = ...) -> None: ...

class TensorData(_message.Message):
    __slots__ = ("key", "offset", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    data: bytes
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class SlotSpec(_message.Message):
    __slots__ = ("key", "param", "start", "numel")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    key: str
    param: str
    start: int
    numel: int
    def __init__(self, key: _Optional[str] = ..., param: _Optional[str] = ..., start: _Optional[int] = ..., numel: _Optional[int] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("name", "lr", "momentum", "nesterov", "weight_decay", "beta1", "beta2", "eps", "schedule", "warmup_steps", "total_steps", "min_lr_ratio", "impl")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    MIN_LR_RATIO_FIELD_NUMBER: _ClassVar[int]
    IMPL_FIELD_NUMBER: _ClassVar[int]
    name: str
    lr: float
    momentum: float
    nesterov: bool
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    schedule: str
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float
    impl: str
    def __init__(self, name: _Optional[str] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., nesterov: _Optional[bool] = ..., weight_decay: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., schedule: _Optional[str] = ..., warmup_steps: _Optional[int] = ..., total_steps: _Optional[int] = ..., min_lr_ratio: _Optional[float] = ..., impl: _Optional[str] = ...) -> None: ...

class LossScaleSpec(_message.Message):
    __slots__ = ("enabled", "init_scale", "growth_factor", "backoff_factor", "growth_interval")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    INIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    GROWTH_FACTOR_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_FACTOR_FIELD_NUMBER: _ClassVar[int]
    GROWTH_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    def __init__(self, enabled: _Optional[bool] = ..., init_scale: _Optional[float] = ..., growth_factor: _Optional[float] = ..., backoff_factor: _Optional[float] = ..., growth_interval: _Optional[int] = ...) -> None: ...

class JobSpec(_message.Message):
    __slots__ = ("mode", "staleness", "num_workers", "optimizer", "loss_scale", "shard_index", "num_shards", "slots", "job_id", "sync_every", "staleness_lr", "delay_compensation", "momentum_correction", "staleness_lr_power", "dc_adaptive", "staleness_rule", "buffer_slots", "buffers_average", "int_buffers", "mode_name", "mode_options", "traits", "param_groups", "chunk_rounds", "early_pull", "max_workers", "data_batches", "data_per_step", "data_stream", "step_options")
    class ModeOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    MODE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    STALENESS_LR_FIELD_NUMBER: _ClassVar[int]
    DELAY_COMPENSATION_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_CORRECTION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_LR_POWER_FIELD_NUMBER: _ClassVar[int]
    DC_ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_RULE_FIELD_NUMBER: _ClassVar[int]
    BUFFER_SLOTS_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_AVERAGE_FIELD_NUMBER: _ClassVar[int]
    INT_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    MODE_NAME_FIELD_NUMBER: _ClassVar[int]
    MODE_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    TRAITS_FIELD_NUMBER: _ClassVar[int]
    PARAM_GROUPS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    EARLY_PULL_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    DATA_BATCHES_FIELD_NUMBER: _ClassVar[int]
    DATA_PER_STEP_FIELD_NUMBER: _ClassVar[int]
    DATA_STREAM_FIELD_NUMBER: _ClassVar[int]
    STEP_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    mode: Mode
    staleness: int
    num_workers: int
    optimizer: OptimizerSpec
    loss_scale: LossScaleSpec
    shard_index: int
    num_shards: int
    slots: _containers.RepeatedCompositeFieldContainer[SlotSpec]
    job_id: str
    sync_every: int
    staleness_lr: bool
    delay_compensation: float
    momentum_correction: bool
    staleness_lr_power: float
    dc_adaptive: bool
    staleness_rule: str
    buffer_slots: _containers.RepeatedScalarFieldContainer[str]
    buffers_average: bool
    int_buffers: _containers.RepeatedCompositeFieldContainer[IntBufferSpec]
    mode_name: str
    mode_options: _containers.ScalarMap[str, float]
    traits: ModeTraits
    param_groups: _containers.RepeatedCompositeFieldContainer[ParamGroupSpec]
    chunk_rounds: bool
    early_pull: bool
    max_workers: int
    data_batches: int
    data_per_step: int
    data_stream: str
    step_options: bool
    def __init__(self, mode: _Optional[_Union[Mode, str]] = ..., staleness: _Optional[int] = ..., num_workers: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., loss_scale: _Optional[_Union[LossScaleSpec, _Mapping]] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., slots: _Optional[_Iterable[_Union[SlotSpec, _Mapping]]] = ..., job_id: _Optional[str] = ..., sync_every: _Optional[int] = ..., staleness_lr: _Optional[bool] = ..., delay_compensation: _Optional[float] = ..., momentum_correction: _Optional[bool] = ..., staleness_lr_power: _Optional[float] = ..., dc_adaptive: _Optional[bool] = ..., staleness_rule: _Optional[str] = ..., buffer_slots: _Optional[_Iterable[str]] = ..., buffers_average: _Optional[bool] = ..., int_buffers: _Optional[_Iterable[_Union[IntBufferSpec, _Mapping]]] = ..., mode_name: _Optional[str] = ..., mode_options: _Optional[_Mapping[str, float]] = ..., traits: _Optional[_Union[ModeTraits, _Mapping]] = ..., param_groups: _Optional[_Iterable[_Union[ParamGroupSpec, _Mapping]]] = ..., chunk_rounds: _Optional[bool] = ..., early_pull: _Optional[bool] = ..., max_workers: _Optional[int] = ..., data_batches: _Optional[int] = ..., data_per_step: _Optional[int] = ..., data_stream: _Optional[str] = ..., step_options: _Optional[bool] = ...) -> None: ...

class ParamGroupSpec(_message.Message):
    __slots__ = ("params", "lr", "momentum", "dampening", "nesterov", "weight_decay", "beta1", "beta2", "eps", "amsgrad")
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    DAMPENING_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    AMSGRAD_FIELD_NUMBER: _ClassVar[int]
    params: _containers.RepeatedScalarFieldContainer[str]
    lr: float
    momentum: float
    dampening: float
    nesterov: bool
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    amsgrad: bool
    def __init__(self, params: _Optional[_Iterable[str]] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., dampening: _Optional[float] = ..., nesterov: _Optional[bool] = ..., weight_decay: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., amsgrad: _Optional[bool] = ...) -> None: ...

class StepOptions(_message.Message):
    __slots__ = ("lrs", "clip_norm", "grad_norm")
    LRS_FIELD_NUMBER: _ClassVar[int]
    CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    lrs: _containers.RepeatedScalarFieldContainer[float]
    clip_norm: float
    grad_norm: float
    def __init__(self, lrs: _Optional[_Iterable[float]] = ..., clip_norm: _Optional[float] = ..., grad_norm: _Optional[float] = ...) -> None: ...

class IntBufferSpec(_message.Message):
    __slots__ = ("name", "numel")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    name: str
    numel: int
    def __init__(self, name: _Optional[str] = ..., numel: _Optional[int] = ...) -> None: ...

class IntValues(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, values: _Optional[_Iterable[int]] = ...) -> None: ...

class InitHeader(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: JobSpec
    def __init__(self, job: _Optional[_Union[JobSpec, _Mapping]] = ...) -> None: ...

class InitChunk(_message.Message):
    __slots__ = ("header", "data", "state")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    header: InitHeader
    data: TensorData
    state: StateChunk
    def __init__(self, header: _Optional[_Union[InitHeader, _Mapping]] = ..., data: _Optional[_Union[TensorData, _Mapping]] = ..., state: _Optional[_Union[StateChunk, _Mapping]] = ...) -> None: ...

class InitReply(_message.Message):
    __slots__ = ("already_initialized", "master_bytes")
    ALREADY_INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    MASTER_BYTES_FIELD_NUMBER: _ClassVar[int]
    already_initialized: bool
    master_bytes: int
    def __init__(self, already_initialized: _Optional[bool] = ..., master_bytes: _Optional[int] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("wait",)
    WAIT_FIELD_NUMBER: _ClassVar[int]
    wait: bool
    def __init__(self, wait: _Optional[bool] = ...) -> None: ...

class InitFailedRequest(_message.Message):
    __slots__ = ("worker", "error")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    worker: int
    error: str
    def __init__(self, worker: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class InitFailedReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopJobRequest(_message.Message):
    __slots__ = ("worker", "num_workers", "reason")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    worker: int
    num_workers: int
    reason: str
    def __init__(self, worker: _Optional[int] = ..., num_workers: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class StopJobReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetJobReply(_message.Message):
    __slots__ = ("initialized", "job", "version", "incarnation", "rounds", "lease_s", "data_port")
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    initialized: bool
    job: JobSpec
    version: int
    incarnation: int
    rounds: int
    lease_s: float
    data_port: int
    def __init__(self, initialized: _Optional[bool] = ..., job: _Optional[_Union[JobSpec, _Mapping]] = ..., version: _Optional[int] = ..., incarnation: _Optional[int] = ..., rounds: _Optional[int] = ..., lease_s: _Optional[float] = ..., data_port: _Optional[int] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("worker", "clock", "base_version", "dtype", "loss_scale", "overflow", "retry", "incarnation", "verdict_follows", "absent", "int_buffers", "options")
    class IntBuffersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: IntValues
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[IntValues, _Mapping]] = ...) -> None: ...
    WORKER_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_FIELD_NUMBER: _ClassVar[int]
    RETRY_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FOLLOWS_FIELD_NUMBER: _ClassVar[int]
    ABSENT_FIELD_NUMBER: _ClassVar[int]
    INT_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    worker: int
    clock: int
    base_version: int
    dtype: DType
    loss_scale: float
    overflow: bool
    retry: bool
    incarnation: int
    verdict_follows: bool
    absent: _containers.RepeatedScalarFieldContainer[str]
    int_buffers: _containers.MessageMap[str, IntValues]
    options: StepOptions
    def __init__(self, worker: _Optional[int] = ..., clock: _Optional[int] = ..., base_version: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., loss_scale: _Optional[float] = ..., overflow: _Optional[bool] = ..., retry: _Optional[bool] = ..., incarnation: _Optional[int] = ..., verdict_follows: _Optional[bool] = ..., absent: _Optional[_Iterable[str]] = ..., int_buffers: _Optional[_Mapping[str, IntValues]] = ..., options: _Optional[_Union[StepOptions, _Mapping]] = ...) -> None: ...

class PushVerdict(_message.Message):
    __slots__ = ("overflow", "absent", "options")
    OVERFLOW_FIELD_NUMBER: _ClassVar[int]
    ABSENT_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    overflow: bool
    absent: _containers.RepeatedScalarFieldContainer[str]
    options: StepOptions
    def __init__(self, overflow: _Optional[bool] = ..., absent: _Optional[_Iterable[str]] = ..., options: _Optional[_Union[StepOptions, _Mapping]] = ...) -> None: ...

class PushChunk(_message.Message):
    __slots__ = ("header", "data", "verdict")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: TensorData
    verdict: PushVerdict
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[_Union[TensorData, _Mapping]] = ..., verdict: _Optional[_Union[PushVerdict, _Mapping]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("applied", "already_applied", "dropped_nonfinite", "version", "staleness", "incarnation")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_APPLIED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    already_applied: bool
    dropped_nonfinite: bool
    version: int
    staleness: int
    incarnation: int
    def __init__(self, applied: _Optional[bool] = ..., already_applied: _Optional[bool] = ..., dropped_nonfinite: _Optional[bool] = ..., version: _Optional[int] = ..., staleness: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker", "clock", "dtype", "incarnation", "early", "clip_total_sq")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EARLY_FIELD_NUMBER: _ClassVar[int]
    CLIP_TOTAL_SQ_FIELD_NUMBER: _ClassVar[int]
    worker: int
    clock: int
    dtype: DType
    incarnation: int
    early: bool
    clip_total_sq: float
    def __init__(self, worker: _Optional[int] = ..., clock: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., incarnation: _Optional[int] = ..., early: _Optional[bool] = ..., clip_total_sq: _Optional[float] = ...) -> None: ...

class RoundNormRequest(_message.Message):
    __slots__ = ("worker", "clock", "incarnation")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker: int
    clock: int
    incarnation: int
    def __init__(self, worker: _Optional[int] = ..., clock: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class RoundNormReply(_message.Message):
    __slots__ = ("sq_norm", "skipped", "incarnation")
    SQ_NORM_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    sq_norm: float
    skipped: bool
    incarnation: int
    def __init__(self, sq_norm: _Optional[float] = ..., skipped: _Optional[bool] = ..., incarnation: _Optional[int] = ...) -> None: ...

class OptimizerStateRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: int
    def __init__(self, worker: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("slot", "name", "numel", "offset", "data", "scalar")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SCALAR_FIELD_NUMBER: _ClassVar[int]
    slot: str
    name: str
    numel: int
    offset: int
    data: bytes
    scalar: bool
    def __init__(self, slot: _Optional[str] = ..., name: _Optional[str] = ..., numel: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., scalar: _Optional[bool] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("version", "rounds", "loss_scale", "last_round_skipped", "skipped_rounds", "dtype", "clock_gap", "incarnation", "early_void", "int_buffers", "batches", "data_done", "live_workers")
    class IntBuffersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: IntValues
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[IntValues, _Mapping]] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CLOCK_GAP_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    EARLY_VOID_FIELD_NUMBER: _ClassVar[int]
    INT_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    DATA_DONE_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    version: int
    rounds: int
    loss_scale: float
    last_round_skipped: bool
    skipped_rounds: int
    dtype: DType
    clock_gap: int
    incarnation: int
    early_void: bool
    int_buffers: _containers.MessageMap[str, IntValues]
    batches: _containers.RepeatedScalarFieldContainer[int]
    data_done: bool
    live_workers: int
    def __init__(self, version: _Optional[int] = ..., rounds: _Optional[int] = ..., loss_scale: _Optional[float] = ..., last_round_skipped: _Optional[bool] = ..., skipped_rounds: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., clock_gap: _Optional[int] = ..., incarnation: _Optional[int] = ..., early_void: _Optional[bool] = ..., int_buffers: _Optional[_Mapping[str, IntValues]] = ..., batches: _Optional[_Iterable[int]] = ..., data_done: _Optional[bool] = ..., live_workers: _Optional[int] = ...) -> None: ...

class PullChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    data: TensorData
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., data: _Optional[_Union[TensorData, _Mapping]] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker", "instance")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    worker: int
    instance: str
    def __init__(self, worker: _Optional[int] = ..., instance: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("live_workers", "write_model")
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WRITE_MODEL_FIELD_NUMBER: _ClassVar[int]
    live_workers: int
    write_model: bool
    def __init__(self, live_workers: _Optional[int] = ..., write_model: _Optional[bool] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("instance",)
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    instance: str
    def __init__(self, instance: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("worker", "live_workers", "clock")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    worker: int
    live_workers: int
    clock: int
    def __init__(self, worker: _Optional[int] = ..., live_workers: _Optional[int] = ..., clock: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("version", "rounds", "updates_applied", "skipped_rounds", "dropped_nonfinite", "live_workers", "loss_scale", "worker_clocks", "max_clock_gap", "staleness_histogram", "master_bytes", "state_digest", "incarnation", "restores", "restored_step", "lease_expirations", "rejoins", "checkpoints_written", "last_checkpoint_step", "live_worker_ids", "draining", "chunks_applied_early", "chunk_undos", "update_params_per_s", "early_pull_slots", "early_pull_voids", "push_paced_s", "optimizer_impl", "gradient_bytes", "joins", "leaves", "data_dealt", "data_returned", "data_remaining", "workers_took_part")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    UPDATES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    WORKER_CLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_CLOCK_GAP_FIELD_NUMBER: _ClassVar[int]
    STALENESS_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    MASTER_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    RESTORED_STEP_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRATIONS_FIELD_NUMBER: _ClassVar[int]
    REJOINS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    LIVE_WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_APPLIED_EARLY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_UNDOS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_PARAMS_PER_S_FIELD_NUMBER: _ClassVar[int]
    EARLY_PULL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    EARLY_PULL_VOIDS_FIELD_NUMBER: _ClassVar[int]
    PUSH_PACED_S_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_IMPL_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    JOINS_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    DATA_DEALT_FIELD_NUMBER: _ClassVar[int]
    DATA_RETURNED_FIELD_NUMBER: _ClassVar[int]
    DATA_REMAINING_FIELD_NUMBER: _ClassVar[int]
    WORKERS_TOOK_PART_FIELD_NUMBER: _ClassVar[int]
    version: int
    rounds: int
    updates_applied: int
    skipped_rounds: int
    dropped_nonfinite: int
    live_workers: int
    loss_scale: float
    worker_clocks: _containers.RepeatedScalarFieldContainer[int]
    max_clock_gap: int
    staleness_histogram: _containers.RepeatedScalarFieldContainer[int]
    master_bytes: int
    state_digest: str
    incarnation: int
    restores: int
    restored_step: int
    lease_expirations: int
    rejoins: int
    checkpoints_written: int
    last_checkpoint_step: int
    live_worker_ids: _containers.RepeatedScalarFieldContainer[int]
    draining: bool
    chunks_applied_early: int
    chunk_undos: int
    update_params_per_s: float
    early_pull_slots: int
    early_pull_voids: int
    push_paced_s: float
    optimizer_impl: str
    gradient_bytes: int
    joins: int
    leaves: int
    data_dealt: int
    data_returned: int
    data_remaining: int
    workers_took_part: int
    def __init__(self, version: _Optional[int] = ..., rounds: _Optional[int] = ..., updates_applied: _Optional[int] = ..., skipped_rounds: _Optional[int] = ..., dropped_nonfinite: _Optional[int] = ..., live_workers: _Optional[int] = ..., loss_scale: _Optional[float] = ..., worker_clocks: _Optional[_Iterable[int]] = ..., max_clock_gap: _Optional[int] = ..., staleness_histogram: _Optional[_Iterable[int]] = ..., master_bytes: _Optional[int] = ..., state_digest: _Optional[str] = ..., incarnation: _Optional[int] = ..., restores: _Optional[int] = ..., restored_step: _Optional[int] = ..., lease_expirations: _Optional[int] = ..., rejoins: _Optional[int] = ..., checkpoints_written: _Optional[int] = ..., last_checkpoint_step: _Optional[int] = ..., live_worker_ids: _Optional[_Iterable[int]] = ..., draining: _Optional[bool] = ..., chunks_applied_early: _Optional[int] = ..., chunk_undos: _Optional[int] = ..., update_params_per_s: _Optional[float] = ..., early_pull_slots: _Optional[int] = ..., early_pull_voids: _Optional[int] = ..., push_paced_s: _Optional[float] = ..., optimizer_impl: _Optional[str] = ..., gradient_bytes: _Optional[int] = ..., joins: _Optional[int] = ..., leaves: _Optional[int] = ..., data_dealt: _Optional[int] = ..., data_returned: _Optional[int] = ..., data_remaining: _Optional[int] = ..., workers_took_part: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker",)
    WORKER_FIELD_NUMBER: _ClassVar[int]
    worker: int
    def __init__(self, worker: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("live", "incarnation", "lease_s")
    LIVE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    live: bool
    incarnation: int
    lease_s: float
    def __init__(self, live: _Optional[bool] = ..., incarnation: _Optional[int] = ..., lease_s: _Optional[float] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker", "clock", "query", "instance", "joined")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    worker: int
    clock: int
    query: bool
    instance: str
    joined: bool
    def __init__(self, worker: _Optional[int] = ..., clock: _Optional[int] = ..., query: _Optional[bool] = ..., instance: _Optional[str] = ..., joined: _Optional[bool] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("incarnation", "clock", "version", "rounds", "live", "rejoined", "lease_s", "restored", "restores")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    REJOINED_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    RESTORES_FIELD_NUMBER: _ClassVar[int]
    incarnation: int
    clock: int
    version: int
    rounds: int
    live: bool
    rejoined: bool
    lease_s: float
    restored: bool
    restores: int
    def __init__(self, incarnation: _Optional[int] = ..., clock: _Optional[int] = ..., version: _Optional[int] = ..., rounds: _Optional[int] = ..., live: _Optional[bool] = ..., rejoined: _Optional[bool] = ..., lease_s: _Optional[float] = ..., restored: _Optional[bool] = ..., restores: _Optional[int] = ...) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("max_round",)
    MAX_ROUND_FIELD_NUMBER: _ClassVar[int]
    max_round: int
    def __init__(self, max_round: _Optional[int] = ...) -> None: ...

class RollbackReply(_message.Message):
    __slots__ = ("rounds", "version", "incarnation", "rolled_back")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    version: int
    incarnation: int
    rolled_back: bool
    def __init__(self, rounds: _Optional[int] = ..., version: _Optional[int] = ..., incarnation: _Optional[int] = ..., rolled_back: _Optional[bool] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "rows", "dim", "optimizer", "lr", "eps", "beta1", "beta2", "init_std", "init_seed", "shard_index", "num_shards")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    INIT_STD_FIELD_NUMBER: _ClassVar[int]
    INIT_SEED_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows: int
    dim: int
    optimizer: str
    lr: float
    eps: float
    beta1: float
    beta2: float
    init_std: float
    init_seed: int
    shard_index: int
    num_shards: int
    def __init__(self, name: _Optional[str] = ..., rows: _Optional[int] = ..., dim: _Optional[int] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., eps: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., init_std: _Optional[float] = ..., init_seed: _Optional[int] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ...) -> None: ...

class CreateTablesRequest(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ...) -> None: ...

class CreateTablesReply(_message.Message):
    __slots__ = ("already_created", "table_bytes")
    ALREADY_CREATED_FIELD_NUMBER: _ClassVar[int]
    TABLE_BYTES_FIELD_NUMBER: _ClassVar[int]
    already_created: bool
    table_bytes: int
    def __init__(self, already_created: _Optional[bool] = ..., table_bytes: _Optional[int] = ...) -> None: ...

class PullRowsRequest(_message.Message):
    __slots__ = ("worker", "table", "ids", "dtype")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    worker: int
    table: str
    ids: bytes
    dtype: DType
    def __init__(self, worker: _Optional[int] = ..., table: _Optional[str] = ..., ids: _Optional[bytes] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class PullRowsChunk(_message.Message):
    __slots__ = ("version", "offset", "data")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    version: int
    offset: int
    data: bytes
    def __init__(self, version: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushRowsHeader(_message.Message):
    __slots__ = ("worker", "clock", "table", "base_version", "dtype", "loss_scale", "overflow", "num_ids")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LOSS_SCALE_FIELD_NUMBER: _ClassVar[int]
    OVERFLOW_FIELD_NUMBER: _ClassVar[int]
    NUM_IDS_FIELD_NUMBER: _ClassVar[int]
    worker: int
    clock: int
    table: str
    base_version: int
    dtype: DType
    loss_scale: float
    overflow: bool
    num_ids: int
    def __init__(self, worker: _Optional[int] = ..., clock: _Optional[int] = ..., table: _Optional[str] = ..., base_version: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., loss_scale: _Optional[float] = ..., overflow: _Optional[bool] = ..., num_ids: _Optional[int] = ...) -> None: ...

class PushRowsChunk(_message.Message):
    __slots__ = ("header", "ids", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushRowsHeader
    ids: bytes
    data: bytes
    def __init__(self, header: _Optional[_Union[PushRowsHeader, _Mapping]] = ..., ids: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushRowsReply(_message.Message):
    __slots__ = ("applied", "already_applied", "version", "staleness")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_APPLIED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    already_applied: bool
    version: int
    staleness: int
    def __init__(self, applied: _Optional[bool] = ..., already_applied: _Optional[bool] = ..., version: _Optional[int] = ..., staleness: _Optional[int] = ...) -> None: ...

class RowsPushWhole(_message.Message):
    __slots__ = ("header", "ids", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushRowsHeader
    ids: bytes
    data: bytes
    def __init__(self, header: _Optional[_Union[PushRowsHeader, _Mapping]] = ..., ids: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushTablesRequest(_message.Message):
    __slots__ = ("pushes",)
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    pushes: _containers.RepeatedCompositeFieldContainer[RowsPushWhole]
    def __init__(self, pushes: _Optional[_Iterable[_Union[RowsPushWhole, _Mapping]]] = ...) -> None: ...

class PushTablesReply(_message.Message):
    __slots__ = ("replies",)
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    replies: _containers.RepeatedCompositeFieldContainer[PushRowsReply]
    def __init__(self, replies: _Optional[_Iterable[_Union[PushRowsReply, _Mapping]]] = ...) -> None: ...

class DataHello(_message.Message):
    __slots__ = ("token", "version", "seal_share", "shm_path", "shm_nonce")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SEAL_SHARE_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    SHM_NONCE_FIELD_NUMBER: _ClassVar[int]
    token: str
    version: int
    seal_share: bytes
    shm_path: str
    shm_nonce: bytes
    def __init__(self, token: _Optional[str] = ..., version: _Optional[int] = ..., seal_share: _Optional[bytes] = ..., shm_path: _Optional[str] = ..., shm_nonce: _Optional[bytes] = ...) -> None: ...

class DataPiece(_message.Message):
    __slots__ = ("key", "offset", "shm_at", "shm_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHM_AT_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    offset: int
    shm_at: int
    shm_bytes: int
    def __init__(self, key: _Optional[str] = ..., offset: _Optional[int] = ..., shm_at: _Optional[int] = ..., shm_bytes: _Optional[int] = ...) -> None: ...

class DataEnd(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataPullRequest(_message.Message):
    __slots__ = ("request", "timeout_s")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request: PullRequest
    timeout_s: float
    def __init__(self, request: _Optional[_Union[PullRequest, _Mapping]] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class DataStatus(_message.Message):
    __slots__ = ("code", "details", "seal_share", "shm")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    SEAL_SHARE_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    seal_share: bytes
    shm: bool
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., seal_share: _Optional[bytes] = ..., shm: _Optional[bool] = ...) -> None: ...

class DataRowsPull(_message.Message):
    __slots__ = ("request",)
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    request: PullRowsRequest
    def __init__(self, request: _Optional[_Union[PullRowsRequest, _Mapping]] = ...) -> None: ...

class DataRows(_message.Message):
    __slots__ = ("version", "shm_at", "shm_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SHM_AT_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: int
    shm_at: int
    shm_bytes: int
    def __init__(self, version: _Optional[int] = ..., shm_at: _Optional[int] = ..., shm_bytes: _Optional[int] = ...) -> None: ...

class DataRowsPush(_message.Message):
    __slots__ = ("request", "ids_bytes", "data_bytes", "shm_at", "shm_bytes")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    IDS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_AT_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    request: PushTablesRequest
    ids_bytes: _containers.RepeatedScalarFieldContainer[int]
    data_bytes: _containers.RepeatedScalarFieldContainer[int]
    shm_at: int
    shm_bytes: int
    def __init__(self, request: _Optional[_Union[PushTablesRequest, _Mapping]] = ..., ids_bytes: _Optional[_Iterable[int]] = ..., data_bytes: _Optional[_Iterable[int]] = ..., shm_at: _Optional[int] = ..., shm_bytes: _Optional[int] = ...) -> None: ...

class DataTablesPull(_message.Message):
    __slots__ = ("requests", "ids_bytes")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    IDS_BYTES_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[PullRowsRequest]
    ids_bytes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, requests: _Optional[_Iterable[_Union[PullRowsRequest, _Mapping]]] = ..., ids_bytes: _Optional[_Iterable[int]] = ...) -> None: ...

class DataTablesRows(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[DataRows]
    def __init__(self, tables: _Optional[_Iterable[_Union[DataRows, _Mapping]]] = ...) -> None: ...

class DataFrame(_message.Message):
    __slots__ = ("hello", "push_header", "piece", "verdict", "end", "pull_request", "pull_header", "push_reply", "status", "rows_pull", "rows", "rows_push", "rows_pushed", "tables_pull", "tables_rows")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    PUSH_HEADER_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    PULL_REQUEST_FIELD_NUMBER: _ClassVar[int]
    PULL_HEADER_FIELD_NUMBER: _ClassVar[int]
    PUSH_REPLY_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ROWS_PULL_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROWS_PUSH_FIELD_NUMBER: _ClassVar[int]
    ROWS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    TABLES_PULL_FIELD_NUMBER: _ClassVar[int]
    TABLES_ROWS_FIELD_NUMBER: _ClassVar[int]
    hello: DataHello
    push_header: PushHeader
    piece: DataPiece
    verdict: PushVerdict
    end: DataEnd
    pull_request: DataPullRequest
    pull_header: PullHeader
    push_reply: PushReply
    status: DataStatus
    rows_pull: DataRowsPull
    rows: DataRows
    rows_push: DataRowsPush
    rows_pushed: PushTablesReply
    tables_pull: DataTablesPull
    tables_rows: DataTablesRows
    def __init__(self, hello: _Optional[_Union[DataHello, _Mapping]] = ..., push_header: _Optional[_Union[PushHeader, _Mapping]] = ..., piece: _Optional[_Union[DataPiece, _Mapping]] = ..., verdict: _Optional[_Union[PushVerdict, _Mapping]] = ..., end: _Optional[_Union[DataEnd, _Mapping]] = ..., pull_request: _Optional[_Union[DataPullRequest, _Mapping]] = ..., pull_header: _Optional[_Union[PullHeader, _Mapping]] = ..., push_reply: _Optional[_Union[PushReply, _Mapping]] = ..., status: _Optional[_Union[DataStatus, _Mapping]] = ..., rows_pull: _Optional[_Union[DataRowsPull, _Mapping]] = ..., rows: _Optional[_Union[DataRows, _Mapping]] = ..., rows_push: _Optional[_Union[DataRowsPush, _Mapping]] = ..., rows_pushed: _Optional[_Union[PushTablesReply, _Mapping]] = ..., tables_pull: _Optional[_Union[DataTablesPull, _Mapping]] = ..., tables_rows: _Optional[_Union[DataTablesRows, _Mapping]] = ...) -> None: ...
