"""vLLM secondary tier: kvstore behind vLLM's own CPU offloading tier.

vLLM 0.33's OffloadingConnector keeps offloaded KV in a CPU primary tier and cascades it
to secondary tiers (`vllm/v1/kv_offload/tiering/`); an out-of-tree tier is named by class
and module in the tier list, so no change to vLLM is needed:

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "KVStoreSecondaryTier",
                             "module_path": "kvstore_client.adapters.vllm",
                             "target": "127.0.0.1:50051"}]}}'

Other tier settings: timeout_s, control ("local" | "grpc"), tenant, io_threads (threads
that move pages, each with its own client), jobs_max (store and load jobs in flight; a
store beyond it is refused at once, see below), locality, and vLLM's own `backpressure`.

What moves where. vLLM hands the tier its primary tier's memory (a memoryview over a
shared mapping, one row per chunk). A store job names chunk rows; the tier puts them
straight from those rows into arena slots, and a load gets them straight from the slots
into the rows vLLM allocated: one copy each way, no buffer in between (the SDK's put and
get take the rows' addresses as (pointer, nbytes) segments). The whole mapping is
registered once with the client (RDMA moves pages inside it without per-call
registration). Transfers run on `io_threads` threads, never on vLLM's scheduler thread.

Keys. A chunk's key is vLLM's OffloadKey as it is: the block hash of the chunk's last
block (its whole prefix, chained by vLLM's --prefix-caching-hash-algo) followed by the
KV cache group index, at most 36 bytes. Keys of one store job are put as one chain in
the job's order, so the store evicts a job's later chunks before its earlier ones.
What makes two engines' chunks interchangeable is the namespace: the model, KV dtype,
tokens per chunk, chunk bytes, the KV cache groups and their layers, and the parallel
layout whose ranks share one chunk row (tp/pp/pcp/dcp sizes, canonical or direct).

Lookups are asynchronous, through vLLM's AsyncLookupManager: the scheduler's per-chunk
lookups of one step become one Lookup per request on a worker thread (answers RETRY until
then). A Lookup answers how many leading keys are present; the keys after the first miss
are asked again, so every key gets its own answer, never one borrowed from its neighbour.

Backpressure, stated as it is: a store job that completes reports the bytes it wrote and
how long it took (vLLM's detectors turn that into pressure); a store that placed fewer
chunks than asked (the node is full of pinned pages) or could not reach the node reports
failure; a store that arrives while `jobs_max` jobs are in flight is refused at once
(failure, counted), so a slow node never queues stores without bound.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from kvstore_client import errors
from kvstore_client.adapters.settings import AdapterSettings, ClientPerThread
from kvstore_client.keys import Namespace
from kvstore_client.lookup import pages_per_part

log = logging.getLogger(__name__)


class Metric:
    """Counters this tier adds to vLLM's offloading metrics (Prometheus, via the connector's stats)."""

    LOOKUP_RPCS = "vllm:kv_offload_kvstore_lookup_rpcs"
    PAGES_ALREADY_STORED = "vllm:kv_offload_kvstore_pages_already_stored"
    PAGES_NOT_STORED = "vllm:kv_offload_kvstore_pages_not_stored"
    STORES_REFUSED = "vllm:kv_offload_kvstore_stores_refused"
    LOAD_MISSES = "vllm:kv_offload_kvstore_load_misses"
    ERRORS = "vllm:kv_offload_kvstore_errors"

    DOCUMENTATION = {
        LOOKUP_RPCS: "Lookup calls made to the kvstore node.",
        PAGES_ALREADY_STORED: "Chunks a store job found already stored in kvstore (nothing copied).",
        PAGES_NOT_STORED: "Chunks a store job asked for that kvstore did not store (node full or unreachable).",
        STORES_REFUSED: "Store jobs refused at once because jobs_max jobs were in flight.",
        LOAD_MISSES: "Chunks a load job asked for that kvstore no longer held.",
        ERRORS: "Jobs and lookups that failed with an error from the kvstore client.",
    }


class KVStoreSecondaryTier(SecondaryTierManager):
    """A vLLM SecondaryTierManager whose chunks live in a kvstore node."""

    medium: ClassVar[Medium] = Medium.CPU   # the node's DRAM arena first, its NVMe tier below it

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str, target: str,
                 timeout_s: float = 5.0, control: str = "local", tenant: str = "", io_threads: int = 2,
                 jobs_max: int = 64, locality: str | None = None, backpressure_detector: Any = None):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if not isinstance(io_threads, int) or io_threads < 1:
            raise ValueError(f"kvstore secondary tier: io_threads must be a positive integer, got {io_threads!r}")
        if not isinstance(jobs_max, int) or jobs_max < 1:
            raise ValueError(f"kvstore secondary tier: jobs_max must be a positive integer, got {jobs_max!r}")
        self.locality = Locality(locality) if locality is not None else None
        settings = AdapterSettings.from_mapping(
            {"target": target, "timeout_s": timeout_s, "control": control, "tenant": tenant}, "",
            "vLLM secondary tier config for kvstore")
        self.namespace = namespace_for(offloading_spec, self.block_size_bytes, tenant)
        rows = np.asarray(primary_kv_view)
        if rows.ndim != 2 or not rows.flags.c_contiguous:
            raise ValueError(f"the primary tier's memory must be C-contiguous rows, got shape {rows.shape}")
        self._rows = rows
        self._base = rows.ctypes.data
        self._clients = ClientPerThread(settings, client_name=f"vllm-{tier_type}")
        self._clients.register_buffer(self._base, rows.nbytes, rows)
        self._pool = concurrent.futures.ThreadPoolExecutor(io_threads, thread_name_prefix="kvstore_vllm_io")
        self._jobs_max = jobs_max
        self._in_flight: set[concurrent.futures.Future] = set()
        self._in_flight_lock = threading.Lock()
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._load_keys: dict[JobId, list[OffloadKey]] = {}
        self._counts = _Counts()
        self._lookups = _KVStoreLookups(self, tier_type)
        log.info("kvstore secondary tier ready: model=%s chunk_bytes=%d tokens=%d target=%s",
                 self.namespace.model, self.namespace.page_bytes, self.namespace.page_tokens, target)

    # -- lookups ----------------------------------------------------------------------

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def present(self, keys: list[OffloadKey]) -> list[bool]:
        """Whether each key is stored, each on its own: one Lookup (per limits.lookup_pages_max keys)."""
        client = self._clients.get()
        held = client.held(self.namespace, keys)
        self._counts.add(Metric.LOOKUP_RPCS, -(-len(keys) // pages_per_part(client.limits)))
        return held

    # -- stores and loads -------------------------------------------------------------

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        rows = self._row_segments(job_metadata.chunk_ids, len(keys))
        if not self._submit(job_metadata.job_id, self._store, keys, rows):
            self._counts.add(Metric.STORES_REFUSED)
            self._finished.put(JobResult(job_id=job_metadata.job_id, success=False))

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        rows = self._row_segments(job_metadata.chunk_ids, len(keys))
        self._load_keys[job_metadata.job_id] = keys
        # vLLM has already allocated the rows and waits for them: a load is never refused.
        self._submit(job_metadata.job_id, self._load, keys, rows, always=True)

    def _submit(self, job_id: JobId, run: Any, keys: list[OffloadKey], rows: list[tuple[int, int]],
                always: bool = False) -> bool:
        with self._in_flight_lock:
            if not always and len(self._in_flight) >= self._jobs_max:
                return False
            future = self._pool.submit(self._run_job, run, job_id, keys, rows)
            self._in_flight.add(future)
        future.add_done_callback(self._job_done)
        return True

    def _run_job(self, run: Any, job_id: JobId, keys: list[OffloadKey], rows: list[tuple[int, int]]) -> None:
        """Run a store or load; whatever it raises, vLLM hears that the job failed.

        vLLM waits for every submitted job to report back, so an exception that escaped the
        worker thread would leave the request (and its blocks) waiting forever."""
        try:
            run(job_id, keys, rows)
        except Exception:
            log.exception("kvstore tier job %s of %d chunks failed", job_id, len(keys))
            self._counts.add(Metric.ERRORS)
            self._finished.put(JobResult(job_id=job_id, success=False))

    def _job_done(self, future: concurrent.futures.Future) -> None:
        with self._in_flight_lock:
            self._in_flight.discard(future)

    def _store(self, job_id: JobId, keys: list[OffloadKey], rows: list[tuple[int, int]]) -> None:
        started = time.monotonic()
        try:
            present = self.present(keys)
            stored = self._clients.get().put(self.namespace, keys, rows)
        except errors.KVStoreError as exc:
            log.warning("kvstore store of %d chunks failed: %s", len(keys), exc)
            self._counts.add(Metric.ERRORS)
            self._finished.put(JobResult(job_id=job_id, success=False))
            return
        copied = sum(1 for hit in present[:stored] if not hit)
        self._counts.add(Metric.PAGES_ALREADY_STORED, stored - copied)
        self._counts.add(Metric.PAGES_NOT_STORED, len(keys) - stored)
        self._finished.put(JobResult(job_id=job_id, success=stored == len(keys),
                                     transfer_time=time.monotonic() - started,
                                     transfer_bytes=copied * self.block_size_bytes))

    def _load(self, job_id: JobId, keys: list[OffloadKey], rows: list[tuple[int, int]]) -> None:
        started = time.monotonic()
        try:
            loaded = self._clients.get().get(self.namespace, keys, rows)
        except errors.KVStoreError as exc:
            log.warning("kvstore load of %d chunks failed: %s", len(keys), exc)
            self._counts.add(Metric.ERRORS)
            loaded = 0
        self._counts.add(Metric.LOAD_MISSES, len(keys) - loaded)
        self._finished.put(JobResult(
            job_id=job_id, success=loaded == len(keys),
            successful_keys=tuple(keys[:loaded]) if 0 < loaded < len(keys) else None,
            transfer_time=time.monotonic() - started, transfer_bytes=loaded * self.block_size_bytes))

    def _row_segments(self, chunk_ids: np.ndarray, count: int) -> list[tuple[int, int]]:
        if len(chunk_ids) != count:
            raise ValueError(f"{count} keys for {len(chunk_ids)} chunk rows")
        rows = len(self._rows)
        segments = []
        for chunk in np.asarray(chunk_ids).tolist():
            if not 0 <= chunk < rows:
                raise ValueError(f"chunk row {chunk} is outside the primary tier's {rows} rows")
            segments.append((self._base + chunk * self.block_size_bytes, self.block_size_bytes))
        return segments

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        while True:
            try:
                result = self._finished.get_nowait()
            except queue.Empty:
                break
            keys = self._load_keys.pop(result.job_id, None)
            if keys is not None and not result.success:
                loaded = len(result.successful_keys or ())
                self._lookups.mark_miss(keys[loaded:])   # stop promising what the node no longer has
            results.append(result)
        return results

    @override
    def has_pending_work(self) -> bool:
        with self._in_flight_lock:
            return bool(self._in_flight)

    @override
    def drain_jobs(self) -> None:
        with self._in_flight_lock:
            pending = list(self._in_flight)
        concurrent.futures.wait(pending)

    # -- requests, steps, metrics -----------------------------------------------------

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {name: OffloadingCounterMetadata(documentation=text) for name, text in Metric.DOCUMENTATION.items()}

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        counts = self._counts.drain()
        if not counts:
            return None
        stats = OffloadingConnectorStats()
        for name, value in counts.items():
            stats.increase_counter(name, value)
        return stats

    def counters(self) -> dict[str, int]:
        """Totals since start (get_stats hands vLLM the increments since its last call)."""
        return self._counts.totals()

    @override
    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._pool.shutdown(wait=True)
        self._clients.close()


def namespace_for(offloading_spec: Any, chunk_bytes: int, tenant: str = "") -> Namespace:
    """What must match for two vLLM engines to share a chunk (see the module docstring)."""
    config = offloading_spec.config
    parallel = config.parallel
    groups = [{"tokens_per_block": g.tokens_per_block, "layers": list(g.layer_names)} for g in config.groups]
    layout = {
        "engine": "vllm", "tier": "tiering", "groups": groups,
        "tokens_per_hash": config.cache.tokens_per_hash, "blocks_per_chunk": config.cache.blocks_per_chunk,
        "tp": parallel.tp_size, "pp": parallel.pp_size, "pcp": parallel.pcp_size, "dcp": parallel.dcp_size,
        "replicated": bool(config.replicated_layout), "canonical": config.kv_cache_layout
        if config.canonical_layout else None,
    }
    tokens_per_chunk = config.cache.tokens_per_hash * config.cache.blocks_per_chunk
    return Namespace(
        model=config.model.name, page_bytes=chunk_bytes, page_tokens=tokens_per_chunk, tenant=tenant,
        kv_dtype=str(config.model.dtype), num_layers=sum(len(g.layer_names) for g in config.groups),
        tp_size=parallel.tp_size, layout=json.dumps(layout, sort_keys=True, separators=(",", ":")))


class _KVStoreLookups(AsyncLookupManager):
    """vLLM's async lookup machinery; the worker thread asks the node."""

    def __init__(self, tier: KVStoreSecondaryTier, tier_type: str):
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        try:
            return self._tier.present(keys)
        except errors.KVStoreError:
            self._tier._counts.add(Metric.ERRORS)
            raise   # vLLM logs it and answers every key a miss


@dataclasses.dataclass
class _Counts:
    """Counters bumped from I/O threads and read on the scheduler thread."""

    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    _since_drain: dict[str, int] = dataclasses.field(default_factory=dict)
    _totals: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, name: str, value: int = 1) -> None:
        if value:
            with self._lock:
                self._since_drain[name] = self._since_drain.get(name, 0) + value
                self._totals[name] = self._totals.get(name, 0) + value

    def drain(self) -> dict[str, int]:
        with self._lock:
            counts, self._since_drain = self._since_drain, {}
        return counts

    def totals(self) -> dict[str, int]:
        with self._lock:
            return dict(self._totals)
