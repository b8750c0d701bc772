"""Host staging for an asynchronous save, and the one background writer whose saves are Futures.

`HostStaging.stage(obj)` copies every tensor storage of a (nested) state into host buffers allocated
once and reused (pinned for CUDA sources), and rebuilds the containers around views of them, so
`torch.save` of the result writes the bytes a synchronous save writes; `begin(obj)` splits that up for
a deferred save (`Staged`). `BackgroundWriter.submit(fn)` runs `fn` on one daemon thread, in order, and
returns a `concurrent.futures.Future` carrying its error (torchtitan's `CheckpointManager` pattern).
What a save copies when, why the state saved is the one of the call, and the trade-off (one snapshot
of host RAM held between saves; the previous write is waited for before the next stage): docs/training.md.
"""
from __future__ import annotations

import copy
import queue
import threading
import time
import traceback
from concurrent.futures import Future


class HostStaging:
    """Reused host buffers for the tensors of one state: one snapshot, allocated on the first save."""

    def __init__(self):
        self._buffers: list = []          # ((bytes, pinned), UntypedStorage) per source storage
        self.allocations = 0              # how many times the buffers were (re)allocated

    def stage(self, obj):
        """A copy of `obj` whose tensors are views of this staging's host buffers (see the module docstring)."""
        staged = self.begin(obj)
        staged.copy(staged.storages)
        return staged.build()

    def begin(self, obj) -> Staged:
        """The buffers of `obj`'s storages, fitted now; the copies and the rebuilt object follow (`Staged`)."""
        import torch

        storages, tensors = _storages_and_tensors(obj, torch)
        buffers = self._fit([(key[3], key[0] != "cpu") if key[0] != "empty" else (0, False) for key in storages],
                            torch)
        return Staged(obj, storages, tensors, dict(zip(storages, buffers)), torch)

    def release(self) -> None:
        """Free the buffers (the next stage allocates them again)."""
        self._buffers = []

    def _fit(self, wanted: list[tuple[int, bool]], torch) -> list:
        """One buffer per wanted (bytes, pinned): the held ones where sizes match, new ones for the rest;
        held buffers nobody wants are freed first, so the buffers never outgrow one snapshot.
        """
        pool: dict = {}
        for key, buffer in self._buffers:
            pool.setdefault(key, []).append(buffer)
        fitted = [pool[key].pop() if pool.get(key) else None for key in wanted]
        if any(buffer is None for buffer in fitted):
            self._buffers = []            # what is not reused goes before anything new is allocated
            fitted = [buffer if buffer is not None else _host_buffer(nbytes, pinned, torch)
                      for buffer, (nbytes, pinned) in zip(fitted, wanted)]
            self.allocations += 1
        self._buffers = list(zip(wanted, fitted))
        return fitted


class Staged:
    """One state being staged: its storages, each with its host buffer; `copy` fills buffers, `build` rebuilds.

    A deferred save copies most storages on the loop's thread (`copy`) and `build`s there (views of the
    buffers); the CUDA storages it defers are enqueued there in stream order (`enqueue`) and waited for on
    the writer's thread (`synchronize`), so the loop's next kernels queue behind them and none can edit
    them first, whatever the path of the edit.
    """

    def __init__(self, obj, storages: dict, tensors: list, buffers: dict, torch):
        self.obj, self.storages, self.tensors, self.buffers, self.torch = obj, storages, tensors, buffers, torch

    def copy(self, keys) -> None:
        """Copy these storages into their buffers now (CUDA: non-blocking, then each device synchronized)."""
        devices = set()
        for key in keys:
            storage = self.storages[key]
            if storage.device.type == "cuda":
                devices.add(storage.device)
            self.buffers[key].copy_(storage, non_blocking=storage.device.type == "cuda")
        for device in devices:
            self.torch.cuda.synchronize(device)   # the pinned copies are complete before the writer reads them

    def enqueue(self, keys) -> dict | None:
        """Start the copies of these CUDA storages on their device's current stream without waiting: every kernel
        launched after this call (an optimizer step, an edit through `.data`) runs after them, so they hold the
        tensors as they are now. {device: an event recorded after them} for `synchronize`; None without any.
        """
        torch, events = self.torch, {}
        for key in keys:
            storage = self.storages[key]
            self.buffers[key].copy_(storage, non_blocking=True)
            events.setdefault(storage.device, None)
        for device in events:
            events[device] = torch.cuda.Event()
            events[device].record(torch.cuda.current_stream(device))
        return events or None

    def synchronize(self, events) -> None:
        """Wait (the writer's thread) until the copies `enqueue` started are in the buffers."""
        for event in (events or {}).values():
            event.synchronize()

    def build(self):
        """`obj` rebuilt around views of the buffers (containers deep-copied, tensors memoized)."""
        torch, memo = self.torch, {}
        for key, tensor in self.tensors:
            staged = torch.empty(0, dtype=tensor.dtype).set_(self.buffers[key], tensor.storage_offset(),
                                                              tensor.size(), tensor.stride())
            if isinstance(tensor, torch.nn.Parameter):      # what torch.save records: the type and the flag
                staged = torch.nn.Parameter(staged, requires_grad=tensor.requires_grad)
            elif tensor.requires_grad:
                staged.requires_grad_(True)
            memo[id(tensor)] = staged
        return copy.deepcopy(self.obj, memo)


class BackgroundWriter:
    """One daemon thread that runs jobs in order; `submit` returns a Future, `writes` each job's seconds."""

    def __init__(self, name: str = "nblib-checkpoint-writer"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.writes: list[float] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, note: str = "") -> Future:
        """Queue `fn`; its Future (result None, or the exception it raised with `note` added)."""
        future: Future = Future()
        self._jobs.put((fn, future, note))
        return future

    def stop(self, timeout: float | None = None) -> bool:
        """End the thread after the queued jobs (or at once when `timeout` is 0); True if it ended."""
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fn, future, note = item
            item = None
            if not future.set_running_or_notify_cancel():
                continue
            start, error = time.perf_counter(), None
            try:
                fn()
            except BaseException as exc:       # handed to the caller through the future
                if note:
                    exc.add_note(note)
                traceback.clear_frames(exc.__traceback__)   # no frame keeps the staged state alive
                error = exc
            self.writes.append(time.perf_counter() - start)   # before the future ends: its waiter reads it
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
            fn = future = error = None         # the job's references go now, not at the next job


def storage_bytes(obj) -> int:
    """Bytes of the distinct tensor storages a nested dict / list / tuple holds (a snapshot's size)."""
    import torch

    return sum(storage.nbytes() for storage in _storages_and_tensors(obj, torch)[0].values())


def _storages_and_tensors(obj, torch) -> tuple[dict, list]:
    """{key: storage} of the distinct storages (first seen first) and (key, tensor) of every tensor of a
    nested dict / list / tuple. A storage's key is its device and address; an empty one is its own.
    """
    storages: dict = {}
    tensors: list = []

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            nbytes, device = storage.nbytes(), storage.device
            key = (device.type, device.index, storage.data_ptr(), nbytes) if nbytes else ("empty", id(value))
            tensors.append((key, value))
            storages.setdefault(key, storage)
        elif isinstance(value, (dict, list, tuple)):
            for item in value.values() if isinstance(value, dict) else value:
                walk(item)

    walk(obj)
    return storages, tensors


def _host_buffer(nbytes: int, pinned: bool, torch):
    """A host storage of `nbytes`: page-locked when it stages a CUDA tensor (async copies need it)."""
    return torch.UntypedStorage(nbytes, device="cpu").pin_memory() if pinned else torch.UntypedStorage(nbytes)
