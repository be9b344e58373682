"""A shard's gRPC server: grpc.aio on an event-loop thread, with a synchronous surface.

Why aio: under the sync grpc.server every call holds a pool thread until it returns, so
`--rpc-threads` pulls waiting for their sync round left none for Stats or for the push that
closes the round (issue #18). grpc.aio runs coroutine handlers on its loop (a waiting
Pull or GetJob parks there, ps/server/pulls/parking.py) and every plain handler in the
`migration_thread_pool`, unchanged: that pool is `--rpc-threads` threads, as before.

A message gRPC cannot decode is refused INVALID_ARGUMENT by the handler (`guard`), not
grpc.aio's UNKNOWN: bad input gets a clear status.

The rest of psar (serve.py, tests, tools) is synchronous: ShardServer keeps the sync
server's methods (add_*_port, start, stop(grace).wait(), wait_for_termination) and runs
each on the loop. One loop thread per process serves every shard server in it (tests
run several); it is a daemon and lives as long as the process.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import grpc

T = TypeVar("T")

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def server_loop() -> asyncio.AbstractEventLoop:
    """The process's gRPC server event loop, running on its own daemon thread."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="psar-grpc-loop", daemon=True).start()
            _loop = loop
        return _loop


def run_on_loop(coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run a coroutine on the server loop from any other thread; its result."""
    return asyncio.run_coroutine_threadsafe(coro, server_loop()).result(timeout)


async def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)


class Undecodable:
    """Stands in for a request message gRPC could not decode. grpc.aio raises the decode
    error outside any handler and answers UNKNOWN ("Unexpected DecodeError"); the sync
    server answered INTERNAL. With this the handler itself refuses it: INVALID_ARGUMENT
    saying so (a streaming request's handler ends its stream, ps/server/doors/servicer.py)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error

    def details(self, method: str) -> str:
        return (
            f"{method}: a request message could not be decoded ({type(self.error).__name__}); "
            "nothing was applied. Is the client built from this shard's proto/psar/v1?"
        )[:512]


def _lenient(deserializer: Any) -> Any:
    if deserializer is None:
        return None

    def deserialize(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception as e:  # noqa: BLE001 - any decode failure is the client's
            return Undecodable(e)

    return deserialize


def guard(method: str, handler: Any) -> Any:
    """`handler` (a grpc.RpcMethodHandler) whose undecodable unary request is refused
    INVALID_ARGUMENT by the handler itself; a streaming request's Undecodable reaches
    the handler's iterator. Keeps the handler's kind (sync, coroutine, async generator)."""
    if handler is None or handler.request_deserializer is None:
        return handler
    bad = grpc.StatusCode.INVALID_ARGUMENT
    if handler.request_streaming:
        return handler._replace(request_deserializer=_lenient(handler.request_deserializer))
    name = "unary_stream" if handler.response_streaming else "unary_unary"
    fn = getattr(handler, name)
    if inspect.isasyncgenfunction(fn):

        async def agen(request: Any, context: Any) -> Any:
            if isinstance(request, Undecodable):
                await context.abort(bad, request.details(method))
            async for reply in fn(request, context):
                yield reply

        wrapped: Any = agen
    elif inspect.iscoroutinefunction(fn):

        async def coro(request: Any, context: Any) -> Any:
            if isinstance(request, Undecodable):
                await context.abort(bad, request.details(method))
            return await fn(request, context)

        wrapped = coro
    elif handler.response_streaming:

        def gen(request: Any, context: Any) -> Any:
            if isinstance(request, Undecodable):
                context.abort(bad, request.details(method))
            yield from fn(request, context)

        wrapped = gen
    else:

        def plain(request: Any, context: Any) -> Any:
            if isinstance(request, Undecodable):
                context.abort(bad, request.details(method))
            return fn(request, context)

        wrapped = plain
    return handler._replace(
        request_deserializer=_lenient(handler.request_deserializer), **{name: wrapped}
    )


class _GuardedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler) -> None:
        self._inner = inner

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        method = handler_call_details.method or ""
        return guard(method, self._inner.service(handler_call_details))


class Stopping:
    """What ShardServer.stop returns, like the sync server's threading.Event."""

    def __init__(self, done: Future) -> None:
        self._done = done

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self._done.result(timeout)
        except TimeoutError:
            return False
        return True

    def is_set(self) -> bool:
        return self._done.done()


class ShardServer:
    """grpc.aio.server(migration_thread_pool=executor) behind the sync server's methods."""

    def __init__(
        self,
        executor: ThreadPoolExecutor,
        *,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        self.executor = executor
        """The --rpc-threads pool: plain handlers, and the short locked steps of parked calls."""
        self.loop = server_loop()

        async def make() -> grpc.aio.Server:  # an aio server belongs to the loop it is made on
            return grpc.aio.server(
                migration_thread_pool=executor,
                options=list(options),
                interceptors=list(interceptors),
            )

        self.aio: grpc.aio.Server = run_on_loop(make())
        self._stopping: Stopping | None = None

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on this server's loop (health status changes, tests)."""
        return run_on_loop(coro, timeout)

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        guarded = tuple(_GuardedGeneric(h) for h in handlers)
        self.run(_call(self.aio.add_generic_rpc_handlers, guarded))

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        guarded = {m: guard(f"/{service}/{m}", h) for m, h in handlers.items()}
        self.run(_call(self.aio.add_registered_method_handlers, service, guarded))

    def add_insecure_port(self, address: str) -> int:
        return self.run(_call(self.aio.add_insecure_port, address))

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        return self.run(_call(self.aio.add_secure_port, address, credentials))

    def start(self) -> None:
        self.run(self.aio.start())

    def stop(self, grace: float | None) -> Stopping:
        """Stop accepting calls; cancel those still running after `grace` seconds (None:
        at once). Returns at once; `.wait()` on the result waits for the end."""
        if self._stopping is None:

            async def stop() -> None:
                try:
                    await self.aio.stop(grace)
                finally:
                    # Parked calls were cancelled above; nothing new comes: let the idle
                    # handler threads go (ones still running finish first).
                    self.executor.shutdown(wait=False, cancel_futures=True)

            self._stopping = Stopping(asyncio.run_coroutine_threadsafe(stop(), self.loop))
        return self._stopping

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Block until the server stops (or `timeout` passes); True if it timed out (as
        grpc's own)."""
        return run_on_loop(self.aio.wait_for_termination(timeout))
