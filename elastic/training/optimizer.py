"""DistributedOptimizer: averages gradients across ranks before the wrapped optimizer steps.

Gradients travel in size-capped buckets (or the groups the caller gives), in
reverse parameter order (the order backward produces them). A post-accumulate
hook launches a bucket's allreduce once its last gradient is ready, so
communication overlaps the rest of backward. Buckets launch strictly in index
order, so every rank issues the same collectives in the same order even when
ranks leave different parameters unused.

Each bucket owns one flat buffer, reused every step. Where the wire dtype is the
parameter's (no compression), ``p.grad`` *is* a view into that buffer, as with
DDP's gradient_as_bucket_view: backward accumulates straight into the bucket,
the allreduce works in place, ``zero_grad()`` zeroes one buffer per bucket, and
no gradient is copied on the way. A new round gets new buffers, as abandoned
gloo work may still write into the old ones. The per-step path does O(1) work
per hook call and per bucket; the layout is rebuilt only when the round or the
trainable set changes.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterable, Sequence

import torch

from elastic.exceptions import ElasticError, WorkersDepartedError
from elastic.training import optimizer_checks as checks
from elastic.training.compression import Compression, Compressor, FP16Compressor, NoneCompressor
from elastic.training.optimizer_layout import build_buckets, detach_views, launch_bucket, zero_grad
from elastic.worker import collectives, runtime
from elastic.worker.collectives import Average, ReduceOp

__all__ = ["Compression", "DistributedOptimizer", "FP16Compressor", "NoneCompressor"]

_OPS = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)


def _remove_hooks(handles):
    for handle in handles:
        handle.remove()


def _delegated(name):
    return property(lambda self: getattr(self._opt, name),
                    lambda self, value: setattr(self._opt, name, value))


class _DistributedOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer; see DistributedOptimizer.

    Optimizer.__init__ is deliberately not called: param_groups, state and
    defaults are the wrapped optimizer's, and unknown attributes delegate to it.
    DistributedOptimizer() returns an instance of a subclass of both this class
    and the wrapped optimizer's class, so isinstance() checks keep working.
    """

    param_groups, state, defaults = (_delegated(n) for n in ("param_groups", "state", "defaults"))

    def __init__(self, optimizer, named_parameters, compression, backward_passes_per_step, op,
                 gradient_predivide_factor, groups, sparse_as_dense, process_set, bucket_cap_mb):
        if op not in _OPS or not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(f"bad op {op!r} or bucket_cap_mb {bucket_cap_mb!r}")
        if gradient_predivide_factor != 1.0:
            if op != Average:
                raise ValueError("gradient_predivide_factor not supported with op != Average")
            if not gradient_predivide_factor > 0:
                raise ValueError(f"gradient_predivide_factor must be > 0, "
                                 f"not {gradient_predivide_factor!r}")
        self._opt, self._compression, self._op = optimizer, compression, op
        self._k = checks.check_passes(backward_passes_per_step)
        self._cap = max(1, int(bucket_cap_mb * 2 ** 20))
        self._names = checks.check_names(optimizer, named_parameters)
        self._groups = checks.check_groups(groups, optimizer)
        self._predivide = float(gradient_predivide_factor)
        self._sparse_as_dense = bool(sparse_as_dense)
        self._process_set = checks.check_process_set(process_set)
        self._lock = threading.Lock()
        self._hook_handles, self._hooked = [], set()
        weakref.finalize(self, _remove_hooks, self._hook_handles)
        self._buckets = None         # built lazily for one round and trainable set
        self._round = None           # the round the buckets were built for
        self._stale = False          # the trainable set changed: rebuild at the next cycle
        self._slot = {}              # param -> (bucket, position in it, index)
        self._stamp, self._count = [], []  # per index: cycle of the last pass, passes in it
        self._cycle = 0
        self._sparse = set()         # params whose gradients come sparse and go back sparse
        self._next = 0               # index of the next bucket to launch
        self._cycle_open = self._synchronized = self._skip = self._no_sync = False
        self._error = None
        self.wire_bytes = 0
        # sees each bucket as it leaves and all of them reduced (LRScaler's adascale rule)
        self.gradient_observer = None
        self._register_hooks()

    def __getattr__(self, name):
        if name == "_opt":  # unpickling, or a failed __init__
            raise AttributeError(name)
        return getattr(self._opt, name)

    def __repr__(self):
        return f"DistributedOptimizer({self._opt!r})"

    # -- Horovod's attributes ----------------------------------------------------------------
    @property
    def op(self):
        """The reduction applied to gradients across ranks (Average unless set otherwise)."""
        return self._op

    @property
    def backward_passes_per_step(self):
        return self._k

    @backward_passes_per_step.setter
    def backward_passes_per_step(self, passes):
        self.set_backward_passes_per_step(passes)

    def set_backward_passes_per_step(self, passes):
        """Change how many backward passes accumulate before the reduction; restarts counting."""
        passes = checks.check_passes(passes)
        with self._lock:
            if any(b.handle is not None for b in self._buckets or ()):
                raise RuntimeError("set_backward_passes_per_step() while gradients are being "
                                   "reduced; call it after step() or synchronize()")
            self._k = passes
            self._end_cycle(drop_buffers=False)

    gradient_predivide_factor, sparse_as_dense, process_set = (
        property(lambda self, _n=n: getattr(self, _n))  # type: ignore[misc]
        for n in ("_predivide", "_sparse_as_dense", "_process_set"))

    # Names from named_parameters, else allreduce.noname.<i> by position, as in Horovod
    # (whose scripts read _parameter_names).
    parameter_names = _parameter_names = property(lambda self: dict(self._names))

    @property
    def bucket_count(self):
        return len(self._buckets or ())

    @property
    def bucket_cap_bytes(self):
        return self._cap

    @property
    def bucket_flats(self):
        """The current buckets' flat buffers (none before the first step of a round)."""
        return [b.flat for b in self._buckets or ()]

    # -- torch.optim.Optimizer -----------------------------------------------------------------
    def state_dict(self):
        return self._opt.state_dict()

    def load_state_dict(self, state_dict):
        self._opt.load_state_dict(state_dict)

    def add_param_group(self, param_group):
        self._opt.add_param_group(param_group)
        self._stale = True
        self._register_hooks()

    def zero_grad(self, set_to_none=True):
        """Zero the gradients; also restarts accumulation.

        Gradients that are views into the buckets stay views, zeroed in place (one
        fill per bucket), so the next backward accumulates straight into them;
        ``p.grad`` is therefore a zero tensor, not None, whatever ``set_to_none``
        says. Other gradients follow the wrapped optimizer's ``zero_grad``.
        """
        with self._lock:
            in_flight = any(b.handle is not None for b in self._buckets or ())
            self._end_cycle(drop_buffers=in_flight)
            fast = self._buckets is not None and not self._stale
            buckets = self._buckets or ()
        if not fast:
            self._opt.zero_grad(set_to_none=set_to_none)
            return
        for bucket in buckets:
            if bucket.as_view:
                bucket.flat.zero_()
            for p in bucket.loose:
                zero_grad(p, set_to_none)
        for p in self._sparse:
            p.grad = None

    def step(self, closure=None):
        """Synchronize (unless inside skip_synchronize()), then step the wrapped optimizer.

        Gradients computed inside a closure are synchronized after each call of it.
        """
        if self._synchronized and not self._skip:
            warnings.warn(checks.STEP_AFTER_SYNCHRONIZE, UserWarning, stacklevel=2)
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
        """Launch the buckets still pending, wait for all, and leave the results in p.grad.

        A parameter without a gradient on this rank sends zeros, so every rank
        runs the same collectives; afterwards it holds the average like the rest.
        A parameter frozen since the buckets were built sends zeros too, and its
        gradient is left None.
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
                if w is not None and (w.membership is None or w.round_id != self._round):
                    raise WorkersDepartedError("membership changed while gradients were in flight")
                self._launch_in_order(all_ready=True)
                for bucket in self._buckets:
                    self._finish(bucket)
                if self.gradient_observer is not None:
                    self.gradient_observer.reduced([b.flat for b in self._buckets], self._op)
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
        """Start an accumulation cycle; rebuild the buckets if the round or trainable set
        changed. O(1) unless it rebuilds."""
        w = runtime.ensure_joined()  # joins a round first if we are between rounds
        round_id = w.round_id if w is not None else 0
        if self._buckets is None or self._stale or round_id != self._round:
            self._rebuild(round_id)
        self._cycle_open, self._synchronized = True, False

    def _rebuild(self, round_id):
        trainable = [p for g in self._opt.param_groups for p in g["params"] if p.requires_grad]
        self._register_hooks()
        as_view = isinstance(self._compression, type) and issubclass(
            self._compression, NoneCompressor)
        detach_views(self._buckets, keep=True)
        self._buckets = build_buckets(trainable, self._groups, self._cap, self._compression,
                                      as_view)
        self._slot = {p: (b, i, n) for n, (b, i, p) in enumerate(
            (b, i, p) for b in self._buckets for i, p in enumerate(b.params))}
        self._stamp, self._count = [-1] * len(self._slot), [0] * len(self._slot)
        self._round, self._stale = round_id, False

    def _end_cycle(self, drop_buffers):
        if drop_buffers:  # in-flight work may still write the old buffers: never reuse them
            detach_views(self._buckets, keep=False)
            self._buckets = self._round = None
        for bucket in self._buckets or ():
            bucket.ready, bucket.handle = 0, None
            if bucket.sparse:
                bucket.sparse = []
            if bucket.frozen:
                bucket.frozen = []
        self._cycle += 1
        self._next, self._cycle_open, self._error = 0, False, None

    def _on_grad_ready(self, p):
        with self._lock:
            if self._error is not None:
                return
            if self._no_sync:
                slot = self._slot.get(p) if self._cycle_open else None
                if slot is not None and slot[0].index < self._next:
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
                slot = self._slot.get(p)
                if slot is None:
                    self._stale = True  # trainable since the buckets were built: next cycle
                    return
                bucket, i, n = slot
                if self._stamp[n] != self._cycle:
                    self._stamp[n], passes = self._cycle, 1
                else:
                    passes = self._count[n] + 1
                self._count[n] = passes
                if passes > self._k:
                    raise checks.TooManyBackwardPassesError(
                        f"gradient of {self._names.get(p, 'a parameter')} was computed {passes} "
                        f"times before step(); set backward_passes_per_step={passes} or call "
                        "step() or synchronize() after each backward pass")
                if passes == self._k:
                    if bucket.as_view:
                        self._adopt(bucket, i, p)
                    bucket.ready += 1
                    if bucket.ready == len(bucket.params):
                        self._launch_in_order()
            except ElasticError as exc:  # raised from synchronize(), not mid-backward
                if isinstance(exc, checks.TooManyBackwardPassesError):
                    raise                    # a usage error: from backward(), as in Horovod
                self._error = exc

    def _adopt(self, bucket, i, p):
        """Make p.grad the bucket's view (a no-op in steady state: backward accumulated
        into it). A gradient that backward made anew is copied in once. No no_grad()
        here: it costs more than the rest of the hook, and no tensor here needs grad."""
        view, grad = bucket.views[i], p.grad
        if grad is view:
            return
        if grad is not None and grad.requires_grad:   # backward(create_graph=True)
            grad = grad.detach()
        if grad is None:
            view.zero_()
        elif grad.is_sparse:
            view.copy_(grad.to_dense())
            self._sparse.add(p)
            bucket.sparse.append((p, i, grad.sparse_dim()))
            return
        else:
            view.copy_(grad)
        p.grad = view

    def _launch_in_order(self, all_ready=False):
        """Launch ready buckets, never one before its predecessors: same order on every rank."""
        buckets = self._buckets
        while self._next < len(buckets):
            bucket = buckets[self._next]
            if bucket.ready != len(bucket.params):
                if not all_ready:
                    return
                self._complete(bucket)
            self._launch(bucket)
            self._next += 1

    def _complete(self, bucket):
        """Before a bucket goes out with gradients missing: unused parameters send what
        p.grad holds (zeros when None); frozen ones send zeros and keep no gradient."""
        for i, p in enumerate(bucket.params):
            n = self._slot[p][2]
            if self._stamp[n] == self._cycle and self._count[n] >= self._k:
                continue
            if not p.requires_grad:
                self._stale = True
                bucket.frozen.append(p)
                if p.grad is not None:
                    p.grad = None
                bucket.views[i].zero_()
            elif bucket.as_view:
                self._adopt(bucket, i, p)

    @torch.no_grad()
    def _launch(self, bucket):
        if not bucket.as_view:
            frozen = set(bucket.frozen)
            for i, (p, view) in enumerate(zip(bucket.params, bucket.views)):
                grad = p.grad
                if p in frozen:
                    continue
                if grad is None:
                    view.zero_()
                    continue
                if grad.is_sparse:
                    grad = grad.to_dense()
                if bucket.cast_only:
                    view.copy_(grad)
                else:
                    wire, bucket.ctxs[i] = self._compression.compress(grad)
                    view.copy_(wire.view(view.shape))
        if self.gradient_observer is not None:
            self.gradient_observer.local(bucket.flat, bucket.index, bucket.index + 1 == len(self._buckets))
        predivide = self._predivide if self._round else 1.0   # not standalone (round 0)
        bucket.handle, sent = launch_bucket(self._process_set, bucket.flat, self._op, predivide)
        self.wire_bytes += sent

    @torch.no_grad()
    def _finish(self, bucket):
        handle, bucket.handle = bucket.handle, None
        if handle is None:
            return  # standalone: the allreduce was an identity, the gradients stand as they are
        collectives.synchronize(handle)
        if self._predivide != 1.0:
            bucket.flat.mul_(self._predivide)
        for p, i, sparse_dim in bucket.sparse:
            p.grad = bucket.views[i].to_sparse(sparse_dim)
        if bucket.as_view:
            return
        frozen = set(bucket.frozen)
        for p, view, ctx in zip(bucket.params, bucket.views, bucket.ctxs):
            if p in frozen:
                continue
            out = view if bucket.cast_only else self._compression.decompress(view, ctx)
            if p.grad is None:
                p.grad = torch.empty_like(p)
            if p.grad.is_sparse:
                p.grad = out.to(p.dtype).to_sparse(p.grad.sparse_dim())
            else:
                p.grad.copy_(out)


_CLASSES: dict = {}


def _class_for(optimizer):
    """A subclass of _DistributedOptimizer and the optimizer's own class, with its name."""
    base = type(optimizer)
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer")
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(base.__name__, (_DistributedOptimizer, base),
                                    {"__module__": __name__,
                                     "__doc__": _DistributedOptimizer.__doc__})
    return cls


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: Compressor = Compression.none, backward_passes_per_step: int = 1,
                         op: str = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: int | Sequence[Sequence[torch.Tensor]] | None = None,
                         sparse_as_dense: bool = False, process_set: checks.ReducingSet | None = None, *,
                         bucket_cap_mb: float | None = None) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that step() applies gradients reduced with ``op`` across ranks.

    Horovod's signature. With backward_passes_per_step=k, gradients accumulate
    locally over k backward passes and are reduced on the k-th; call step() after
    it. Backward passes inside ``no_sync()`` accumulate locally and are not
    counted. ``gradient_predivide_factor`` f (Average only) divides by f before
    the sum and multiplies by f/size after. ``groups`` (an int, or lists of
    parameters; ``num_groups`` is its old name) fixes which gradients travel
    together: each group is one bucket, and the parameters in no group go in
    buckets that close once they reach ``bucket_cap_mb`` MiB (default:
    $HOROVOD_FUSION_THRESHOLD bytes, which ``elasticrun --fusion-threshold-mb`` sets,
    else 25), the first at 1 MiB, as torch DDP's buckets do. Sparse gradients travel dense
    (as with Horovod's ``sparse_as_dense``, which is accepted) and come back sparse.
    ``process_set``: gradients are reduced over that set; ranks outside it step with
    their own gradients, as in Horovod. Outside elasticrun (size 1) it steps exactly like the wrapped
    optimizer. The result is an instance of the wrapped optimizer's class.
    """
    if num_groups and groups is None:
        groups = num_groups
    if bucket_cap_mb is None:
        bucket_cap_mb = checks.default_bucket_cap_mb()
    cls = _class_for(optimizer)
    return cls(optimizer, named_parameters, compression, backward_passes_per_step, op,
               gradient_predivide_factor, groups, sparse_as_dense, process_set, bucket_cap_mb)

