"""DistributedOptimizer: averages gradients across ranks before the wrapped optimizer steps.

Gradients travel in size-capped buckets, in reverse parameter order (the order
backward produces them). A post-accumulate hook launches a bucket's allreduce
once its last gradient is ready, so communication overlaps the rest of
backward. Buckets launch strictly in index order, so every rank issues the same
collectives in the same order even when ranks leave different parameters
unused. Each bucket owns one preallocated flat buffer, reused every step; a new
round gets new buffers, as abandoned gloo work may still write into the old ones.
"""

import collections
import contextlib
import threading
import weakref

import torch

from elastic.exceptions import WorkersDepartedError
from elastic.worker import collectives, runtime
from elastic.worker.collectives import Average, ReduceOp

_OPS = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)


class NoneCompressor:
    """Sends gradients as they are.

    A compressor is any object with compress(tensor) -> (wire, ctx) and
    decompress(wire, ctx) -> tensor. One that only changes the dtype may also
    define wire_dtype(dtype): buckets then cast with copy_ into their
    preallocated buffers instead of calling compress/decompress, which allocate.
    """

    @staticmethod
    def wire_dtype(dtype):
        return dtype

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor:
    """Halves the bytes of floating gradients on the wire; other dtypes pass unchanged."""

    @staticmethod
    def wire_dtype(dtype):
        return torch.float16 if dtype.is_floating_point else dtype

    @staticmethod
    def compress(tensor):
        return tensor.to(FP16Compressor.wire_dtype(tensor.dtype)), tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor.to(ctx)


class Compression:
    """The built-in compressors, named as in Horovod."""

    none = NoneCompressor
    fp16 = FP16Compressor


class _Bucket:
    __slots__ = ("params", "views", "ctxs", "flat", "nbytes", "ready", "handle")

    def __init__(self):
        self.params, self.views, self.ctxs = [], [], []
        self.flat, self.nbytes, self.ready, self.handle = None, 0, 0, None


def _remove_hooks(handles):
    for handle in handles:
        handle.remove()


def _delegated(name):
    return property(lambda self: getattr(self._opt, name),
                    lambda self, value: setattr(self._opt, name, value))


class _DistributedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer; subclasses Optimizer only so that lr schedulers accept it.

    Optimizer.__init__ is deliberately not called: param_groups, state and
    defaults are the wrapped optimizer's, and unknown attributes delegate to it.
    """

    param_groups, state, defaults = (_delegated(n) for n in ("param_groups", "state", "defaults"))

    def __init__(self, optimizer, named_parameters, compression, backward_passes_per_step, op,
                 bucket_cap_mb):
        if not (isinstance(backward_passes_per_step, int) and backward_passes_per_step >= 1):
            raise ValueError(f"backward_passes_per_step must be an int >= 1, "
                             f"not {backward_passes_per_step!r}")
        if op not in _OPS or not bucket_cap_mb > 0:
            raise ValueError(f"bad op {op!r} or bucket_cap_mb {bucket_cap_mb!r}")
        self._opt, self._compression, self._op = optimizer, compression, op
        self._cast_only = hasattr(compression, "wire_dtype")
        self._k = backward_passes_per_step
        self._cap = max(1, int(bucket_cap_mb * 2 ** 20))
        self._names = _check_names(optimizer, named_parameters)
        self._lock = threading.Lock()
        self._hook_handles, self._hooked = [], set()
        weakref.finalize(self, _remove_hooks, self._hook_handles)
        self._buckets = self._built_for = None  # built lazily for one round and trainable set
        self._slot, self._passes = {}, {}       # param -> bucket; param -> passes this cycle
        self._next = 0                          # index of the next bucket to launch
        self._cycle_open = self._synchronized = self._skip = self._no_sync = False
        self._error = None
        self.wire_bytes = 0
        self._register_hooks()

    def __getattr__(self, name):
        if name == "_opt":  # unpickling, or a failed __init__
            raise AttributeError(name)
        return getattr(self._opt, name)

    def __repr__(self):
        return f"DistributedOptimizer({self._opt!r})"

    def state_dict(self):
        return self._opt.state_dict()

    def load_state_dict(self, state_dict):
        self._opt.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        self._opt.add_param_group(param_group)
        self._register_hooks()

    def zero_grad(self, set_to_none=True):
        """Also restarts accumulation, as zeroing the gradients does."""
        with self._lock:
            self._end_cycle(drop_buffers=any(b.handle is not None for b in self._buckets or ()))
        self._opt.zero_grad(set_to_none=set_to_none)

    @property
    def bucket_count(self):
        return len(self._buckets or ())

    def step(self, closure=None):
        """Synchronize (unless inside skip_synchronize()), then step the wrapped optimizer.

        Gradients computed inside a closure are synchronized after each call of it.
        """
        if closure is not None:
            def synced_closure():
                loss = closure()
                self.synchronize()
                return loss
            result = self._opt.step(synced_closure)
        else:
            if not self._skip:
                self.synchronize()
            elif self._cycle_open and not self._synchronized:
                raise RuntimeError("step() inside skip_synchronize() needs synchronize() after "
                                   "backward; otherwise gradients are not averaged")
            result = self._opt.step()
        self._synchronized = False
        return result

    @property
    def op(self):
        """The reduction applied to gradients across ranks (Average unless set otherwise)."""
        return self._op

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate into p.grad locally, without communication
        and without counting towards backward_passes_per_step, as in DDP's no_sync().

        The next backward pass outside reduces the accumulated sum. This is how a rank
        runs a number of micro-batches that differs between ranks and steps (see
        ``ElasticSampler(global_batch_size=...)``): all micro-batches but the last go
        inside no_sync().
        """
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For a step() after an explicit synchronize(), e.g. to clip the averaged gradients."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def synchronize(self):
        """Launch the buckets still pending, wait for all, and write the results into p.grad.

        A parameter without a gradient on this rank sends zeros, so every rank
        runs the same collectives; afterwards it holds the average like the rest.
        """
        with self._lock:
            if self._error is not None:
                error = self._error
                self._end_cycle(drop_buffers=True)
                raise error
            if self._synchronized:
                return  # nothing new since the last synchronize()
            try:
                if not self._cycle_open:
                    self._open_cycle()
                w = runtime.worker()  # in-flight work belongs to its round: never join one here
                if w is not None and (w.membership is None or w.round_id != self._built_for[0]):
                    raise WorkersDepartedError("membership changed while gradients were in flight")
                self._launch_in_order(all_ready=True)
                for bucket in self._buckets:
                    self._finish(bucket)
            except WorkersDepartedError:
                self._end_cycle(drop_buffers=True)
                raise
            self._end_cycle(drop_buffers=False)
            self._synchronized = True

    # -- internals ------------------------------------------------------------------------
    def _register_hooks(self):
        ref = weakref.ref(self)  # a discarded wrapper must not keep reducing gradients

        def hook(param):
            opt = ref()
            if opt is not None:
                opt._on_grad_ready(param)

        for group in self._opt.param_groups:
            for p in group["params"]:
                if p.requires_grad and p not in self._hooked:
                    self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))
                    self._hooked.add(p)

    def _open_cycle(self):
        """Start an accumulation cycle; rebuild buckets if the round or trainable set changed."""
        trainable = [p for g in self._opt.param_groups for p in g["params"] if p.requires_grad]
        w = runtime.ensure_joined()  # joins a round first if we are between rounds
        key = (w.round_id if w is not None else 0, tuple(map(id, trainable)))
        if self._buckets is None or key != self._built_for:
            self._register_hooks()
            self._build(trainable)
            self._built_for = key
        self._cycle_open, self._synchronized = True, False

    def _end_cycle(self, drop_buffers):
        if drop_buffers:  # in-flight work may still write the old buffers: never reuse them
            self._buckets = self._built_for = None
        for bucket in self._buckets or ():
            bucket.ready, bucket.handle = 0, None
        self._passes.clear()
        self._next, self._cycle_open, self._error = 0, False, None

    def _build(self, trainable):
        buckets, open_buckets = [], {}
        for p in reversed(trainable):
            nbytes = p.numel() * p.element_size()
            bucket = open_buckets.get((p.dtype, p.device))
            if bucket is None or bucket.nbytes + nbytes > self._cap:
                bucket = open_buckets[(p.dtype, p.device)] = _Bucket()
                buckets.append(bucket)
            bucket.params.append(p)
            bucket.nbytes += nbytes
        self._slot = {}
        for bucket in buckets:
            first = bucket.params[0]
            if self._cast_only:
                dtype = self._compression.wire_dtype(first.dtype)
            else:
                dtype = self._compression.compress(first.new_zeros(1))[0].dtype
            bucket.flat = torch.zeros(sum(p.numel() for p in bucket.params), dtype=dtype,
                                      device=first.device)
            offset = 0
            for p in bucket.params:
                bucket.views.append(bucket.flat[offset: offset + p.numel()].view(p.shape))
                bucket.ctxs.append(None)
                offset += p.numel()
                self._slot[p] = bucket
        self._buckets = buckets

    def _on_grad_ready(self, p):
        with self._lock:
            if self._error is not None:
                return
            if self._no_sync:
                bucket = self._slot.get(p) if self._cycle_open else None
                if bucket is not None and self._buckets.index(bucket) < self._next:
                    raise RuntimeError(
                        f"gradient of {self._names.get(p, 'a parameter')} changed inside "
                        "no_sync() after its allreduce was launched in this step; "
                        "run the backward passes inside no_sync() first")
                self._synchronized = False   # step() must reduce what accumulated here
                return
            try:
                if not self._cycle_open:
                    self._open_cycle()
                self._synchronized = False
                bucket = self._slot.get(p)
                if bucket is None:
                    return  # not trainable when this cycle began; bucketed from the next one
                passes = self._passes[p] = self._passes.get(p, 0) + 1
                if passes > self._k:
                    raise RuntimeError(
                        f"gradient of {self._names.get(p, 'a parameter')} was computed {passes} "
                        f"times before step(); set backward_passes_per_step={passes} or call "
                        "step() or synchronize() after each backward pass")
                if passes == self._k:
                    bucket.ready += 1
                    self._launch_in_order()
            except WorkersDepartedError as exc:  # raised from synchronize(), not mid-backward
                self._error = exc

    def _launch_in_order(self, all_ready=False):
        """Launch ready buckets, never one before its predecessors: same order on every rank."""
        while self._next < len(self._buckets):
            bucket = self._buckets[self._next]
            if not (all_ready or bucket.ready == len(bucket.params)):
                return
            self._launch(bucket)
            self._next += 1

    @torch.no_grad()
    def _launch(self, bucket):
        for i, (p, view) in enumerate(zip(bucket.params, bucket.views)):
            grad = p.grad
            if grad is None:
                view.zero_()
            elif grad.is_sparse:
                raise ValueError("DistributedOptimizer does not support sparse gradients")
            elif self._cast_only:
                view.copy_(grad)
            else:
                wire, bucket.ctxs[i] = self._compression.compress(grad)
                view.copy_(wire.view(view.shape))
        self.wire_bytes += bucket.flat.numel() * bucket.flat.element_size()
        bucket.handle = collectives.allreduce_async(bucket.flat, self._op)

    @torch.no_grad()
    def _finish(self, bucket):
        handle, bucket.handle = bucket.handle, None
        if handle is None:
            return  # standalone: the allreduce was an identity, the gradients stand as they are
        collectives.synchronize(handle)
        for p, view, ctx in zip(bucket.params, bucket.views, bucket.ctxs):
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(view if self._cast_only else self._compression.decompress(view, ctx))


def _check_names(optimizer, named_parameters):
    """Names only label errors, but a wrong list usually means the wrong model was passed."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is None:
        return {p: f"parameter {i}" for i, p in enumerate(params)}
    named = list(named_parameters)
    if not all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
               for item in named):
        raise ValueError("named_parameters must be (name, parameter) pairs, "
                         "as model.named_parameters() gives")
    duplicates = sorted(n for n, c in collections.Counter(n for n, _ in named).items() if c > 1)
    if duplicates:
        raise ValueError(f"named_parameters has duplicate names: {duplicates}")
    names = {p: n for n, p in named}
    missing = sum(1 for p in params if p not in names)
    if missing:
        raise ValueError(f"{missing} parameter(s) of the optimizer are not in named_parameters; "
                         "pass the named_parameters() of the model the optimizer trains")
    return names


def DistributedOptimizer(optimizer, named_parameters=None, compression=Compression.none,
                         backward_passes_per_step=1, op=Average, bucket_cap_mb=25):
    """Wrap ``optimizer`` so that step() applies gradients reduced with ``op`` across ranks.

    With backward_passes_per_step=k, gradients accumulate locally over k
    backward passes and are reduced on the k-th; call step() after it.
    Backward passes inside ``no_sync()`` accumulate locally and are not counted.
    Outside elasticrun (size 1) it steps exactly like the wrapped optimizer.
    """
    return _DistributedOptimizer(optimizer, named_parameters, compression,
                                 backward_passes_per_step, op, bucket_cap_mb)
