"""GraphRunner: a group of compatible steps as one padded batch on static buffers, replayed as a CUDA graph.

For each (signature, batch bucket, lane) the runner owns one `BucketGraph`: static input buffers
allocated when the bucket is first used, the compiled step built at that batch (shared by the
lanes), and on CUDA a graph captured over the compiled step (warm-up on a side stream, one memory
pool shared by every graph). A run copies the group's inputs into the first rows, fills the padding
rows with `pad_value`, replays, and copies the outputs out once before anything can replay again;
each request gets a view of its rows. On CPU the same code calls the compiled step on the same static
buffers, so batching, padding and scatter are exercised without a GPU.

Hoisted prologue values are per request: they are computed when a request in the group has none
yet, by the prologue of the smallest prepared bucket that holds the requests that lack them (an
arrival into a running batch costs a batch-1 prologue), and kept in that request's RequestSlot
(fvgraph/runtime/request_slot.py), which the runtime owns, for every bucket it runs at. They carry
the batch in dim 0, branch-major (rows `k * bucket + i` for CFG branch k), so a value is `m` rows
per request with `m = rows / bucket`. A row of the static buffers (hoisted values, and inputs that
are constant for a request) is rewritten only when it changes hands; the scheduler keeps requests
in their rows, so most runs find every row's owner as it was and look no further. A constant the
step no longer reads (a text whose every use was hoisted) is written only for the requests a
prologue computes, and not at all for a lone arrival: a batch-1 prologue reads the request's own
tensors.

Callers hold `torch.no_grad()` (the compiled executor does, once per batch).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from fvgraph.compile.compiler import CompiledStep, StepCompiler
from fvgraph.contract.counters import Counters
from fvgraph.passes.finite_flags import FINITE_OUTPUT
from fvgraph.runtime.batch_results import BatchResults, request_rows
from fvgraph.runtime.graph_capture import capture_graph
from fvgraph.contract.step_kind import Role
from fvgraph.contract.plan import StepResult, WorkPlan
from fvgraph.runtime.request_slot import RequestSlot

log = logging.getLogger(__name__)
_UNWRITTEN = object()  # a row no request or padding has been written into yet


@dataclass
class BucketGraph:
    compiled: CompiledStep
    bucket: int
    inputs: dict[str, torch.Tensor]  # static, [bucket, ...] each
    hoisted: list[torch.Tensor] = field(default_factory=list)  # static, [m * bucket, ...] each
    rows_per_request: list[int] = field(default_factory=list)  # m of each hoisted value
    # What a request's hoisted values are kept under: the step at any bucket, and their per-request
    # layout and the constants they come from. Every hoisted value carries request data, so its rows
    # are the batch's (hoist_invariants leaves what is built from shapes alone in the step).
    values_key: tuple = ()
    graph: object | None = None  # torch.cuda.CUDAGraph once captured
    outputs: tuple[torch.Tensor, ...] = ()  # the graph's static outputs
    addresses: tuple[int, ...] = ()  # data_ptr of every static buffer at capture (debug checks)
    storages: frozenset[int] = frozenset()  # storage of every static argument (an output aliasing one is copied out)
    recapture: bool = False  # its graph was dropped (the weights it read moved): capture again at the next run
    # Per row: whose request constants the input buffers hold, and whose hoisted values (the owner is
    # the request's RequestSlot, held so its identity cannot be reused; None: a padding row).
    input_owners: list = field(default_factory=list)
    hoisted_for: list = field(default_factory=list)
    # The input buffers by role, fixed at preparation: each run refills the per-step ones and only
    # the changed rows of the per-request constants the step reads. Constants only the prologue reads
    # (a text whose every use was hoisted) are written just for the requests a prologue computes.
    per_step: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    constants: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    prologue_constants: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    input_at: dict[int, tuple[str, torch.Tensor]] = field(default_factory=dict)  # input buffers by data_ptr
    pad_from: int = 0  # the per-step buffers' rows from here on hold padding (bucket: none written yet)

    def base_args(self) -> list[torch.Tensor]:
        """What the prologue takes: parameters, then the step inputs."""
        return [*self.compiled.params, *(self.inputs[name] for name in self.compiled.input_names)]

    @functools.cached_property
    def args(self) -> list[torch.Tensor]:
        """What the step takes: the base arguments, then the hoisted values. The buffers never move,
        so the list is built once."""
        return [*self.base_args(), *self.hoisted]


class GraphRunner:
    def __init__(self, compiler: StepCompiler, counters: Counters, cuda_graphs: bool, debug: bool = False,
                 pad_value: float = 0.0):  # fmt: skip
        self.compiler = compiler
        self.counters = counters
        self.cuda_graphs = cuda_graphs
        self.debug = debug
        self._graphs: dict[tuple, BucketGraph] = {}
        self.pad_value = pad_value
        self._pool = None
        self._capture_failed: set[tuple] = set()

    @property
    def pad_value(self) -> float:
        """What padding rows hold (tests poison them with NaN to prove padding never reaches a result)."""
        return self._pad_value

    @pad_value.setter
    def pad_value(self, value: float) -> None:
        self._pad_value = value
        for entry in self._graphs.values():  # padding rows already written hold the old value
            entry.input_owners = entry.hoisted_for = [_UNWRITTEN] * entry.bucket
            entry.pad_from = entry.bucket

    def run(self, step: nn.Module, plans: list[WorkPlan], slots: list[RequestSlot], bucket: int,
            lane: int = 0) -> BatchResults:  # fmt: skip
        """Run `plans` (same signature, len <= bucket) as one batch; one result per plan. `slots` are
        the plans' requests' runtime slots, in plan order. Each `lane` has its own static buffers
        (and graph), sharing the compiled step. On CUDA the copies into the buffers queue on the
        stream behind the batches before, so a run may be issued while an earlier one still runs
        (fvgraph/engine/run_ahead.py): its outputs were copied out at its launch."""
        entry = self._entry(step, plans, slots, bucket, lane)
        if entry.graph is None and self.cuda_graphs and entry.recapture:  # its graph was dropped (drop_graphs)
            entry.recapture = False
            self._capture(entry, (plans[0].signature, bucket, lane))
        self._fill(entry, plans, slots)
        return self._scatter(entry, plans, self._replay(entry))

    def _entry(self, step: nn.Module, plans: list[WorkPlan], slots: list[RequestSlot], bucket: int, lane: int) -> BucketGraph:
        entry = self._graphs.get((plans[0].signature, bucket, lane))
        return entry if entry is not None else self._prepare(step, plans, slots, bucket, lane)

    def _fill(self, entry: BucketGraph, plans: list[WorkPlan], slots: list[RequestSlot]) -> None:
        owners = [*slots, *[None] * (entry.bucket - len(plans))]
        self._fill_inputs(entry, plans, owners)
        if entry.compiled.prologue_fn is not None:
            self._fill_hoisted(entry, plans, slots, owners)

    def _scatter(self, entry: BucketGraph, plans: list[WorkPlan], outs: tuple[torch.Tensor, ...]) -> BatchResults:
        """Each output, one value per request. An output that is an input buffer passed through (a
        sampler's history shifting by one) is each request's own input tensor, as it came in: no copy,
        and no finite check (a step produced it, checked then, or the loop made it at admission).
        Any other output a later run could overwrite (a graph's static output, an alias of a static
        argument) is copied out once per batch, not once per request, and each request gets a view.
        The step's finite flags (passes/finite_flags.py) come back beside the rows, not in them."""
        n, names, columns, batch, flags = len(plans), [], [], {}, None
        for name, out in zip(entry.compiled.output_names, outs):
            if name == FINITE_OUTPUT:
                flags = out
                continue
            names.append(name)
            source = entry.input_at.get(out.data_ptr())
            if source is not None and out.shape == source[1].shape and out.stride() == source[1].stride():
                columns.append([plan.inputs[source[0]] for plan in plans])
                continue
            if entry.graph is not None or out.untyped_storage().data_ptr() in entry.storages:
                out = out.clone()
            batch[name] = out
            columns.append(request_rows(out, entry.bucket, n))
        rows = [dict(zip(names, row)) for row in zip(*columns)]
        if flags is None:  # a step whose every output is an input passed through computed nothing to check
            flags = torch.ones(entry.bucket, dtype=torch.bool, device=outs[0].device if outs else "cpu")
        return BatchResults(rows, batch, flags)

    # -- preparing a bucket --------------------------------------------------------------------------

    def _prepare(self, step: nn.Module, plans: list[WorkPlan], slots: list[RequestSlot], bucket: int,
                 lane: int) -> BucketGraph:  # fmt: skip
        inputs = {name: self._padded_like(t, bucket) for name, t in plans[0].inputs.items()}
        example = WorkPlan(plans[0].request_id, plans[0].kind, inputs, signature=plans[0].signature)  # its facts past the shapes too
        entry = BucketGraph(self.compiler.get(step, example, batch=bucket), bucket, inputs)
        entry.input_owners = entry.hoisted_for = [_UNWRITTEN] * bucket
        entry.pad_from = bucket
        kind = self.compiler.step_kinds[plans[0].kind]
        for name, buffer in inputs.items():  # constants stay in place while their request keeps its row
            if kind.input_role(name) is not Role.CONSTANT:
                entry.per_step.append((name, buffer))
            else:
                unread = name in entry.compiled.unread_inputs
                (entry.prologue_constants if unread else entry.constants).append((name, buffer))
        self._fill_inputs(entry, plans, [*slots, *[None] * (bucket - len(plans))])
        device = next(iter(inputs.values())).device
        entry.hoisted = [
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device) for t in entry.compiled.hoisted_like
        ]
        entry.rows_per_request = [t.shape[0] // bucket for t in entry.hoisted]
        constant_names = tuple(name for name in inputs if kind.input_role(name) is Role.CONSTANT)
        entry.values_key = (entry.compiled.signature.unbatched_key, constant_names,
                            *((m, tuple(t.shape[1:]), t.dtype) for t, m in zip(entry.hoisted, entry.rows_per_request)))  # fmt: skip
        entry.storages = frozenset(t.untyped_storage().data_ptr() for t in entry.args)
        entry.input_at = {buffer.data_ptr(): (name, buffer) for name, buffer in inputs.items()}
        key = (plans[0].signature, bucket, lane)
        self._graphs[key] = entry
        if self.cuda_graphs and key not in self._capture_failed:
            self._capture(entry, key)
        return entry

    def _padded_like(self, t: torch.Tensor, bucket: int) -> torch.Tensor:
        # Zeros, not empty: the compiler runs the step once on these buffers before any row is written,
        # and an integer input (an adapter slot index) must be a valid index then.
        return torch.zeros((bucket, *t.shape[1:]), dtype=t.dtype, device=t.device)

    def _capture(self, entry: BucketGraph, key: tuple) -> None:
        """Capture into the shared pool; a failure means no graph for this key, logged once, and a fresh
        pool for later captures (graph_capture leaves the failed one released)."""
        began = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            entry.graph, entry.outputs = capture_graph(entry.compiled.step_fn, entry.args, self._pool)
        except Exception as err:  # a capture failure costs the graph, never the request
            self._capture_failed.add(key)
            self._pool = None
            entry.graph, entry.outputs = None, ()
            log.warning("CUDA graph capture failed for %s batch %d; running the compiled step instead: %s",
                        entry.compiled.signature.step_kind, entry.bucket, err)  # fmt: skip
            return
        entry.addresses = tuple(t.data_ptr() for t in entry.args)
        self.counters.captures += 1
        if self.compiler.capture_cache is not None and key[2] == 0:  # the manifest records lane 0's capture time
            self.compiler.capture_cache.annotate(entry.compiled.signature.key(), capture_seconds=time.perf_counter() - began)

    def drop_graphs(self) -> int:
        """Drop every captured CUDA graph and the memory pool they share (an engine's sleep: the weights
        they read are about to be freed, and a graph replayed after wake would read the old addresses).
        Each bucket captures again the next time it runs (counters.captures); returns how many were dropped."""
        dropped = 0
        for entry in self._graphs.values():
            if entry.graph is not None:
                entry.graph, entry.outputs, entry.addresses, entry.recapture = None, (), (), True
                dropped += 1
        self._pool = None
        self.counters.graphs_dropped += dropped
        return dropped

    # -- one run ---------------------------------------------------------------------------------------

    def _fill_inputs(self, entry: BucketGraph, plans: list[WorkPlan], owners: list) -> None:
        """Step inputs into the first rows, padding after. Inputs that are constant for a request
        (its embeddings, its guidance scale) are written only into rows that changed hands, and only
        those the step reads (the prologue's alone are _run_prologue's)."""
        n = len(plans)
        for name, buffer in entry.per_step:
            if n == 1:
                buffer[:1].copy_(plans[0].inputs[name])
            else:
                torch.cat([plan.inputs[name] for plan in plans], dim=0, out=buffer if n == entry.bucket else buffer[:n])
            if n < entry.pad_from:  # rows from pad_from on still hold padding from an earlier run
                buffer[n : entry.pad_from].fill_(self.pad_value if buffer.is_floating_point() else 0)
        entry.pad_from = n
        if owners == entry.input_owners:  # the usual step: every request kept its row (owners compare by identity)
            return
        changed = _changed_rows(owners, entry.input_owners)
        if changed:
            self._write_constants(entry, changed, owners, lambda i: plans[i].inputs)
            entry.input_owners = owners

    def _fill_hoisted(self, entry: BucketGraph, plans: list[WorkPlan], slots: list[RequestSlot], owners: list) -> None:
        if owners == entry.hoisted_for:  # every row holds its request's values already (owners compare by identity)
            return
        key = entry.values_key
        missing = [i for i, slot in enumerate(slots) if slot.hoisted_for(key) is None]
        if missing:
            self._run_prologue(entry, plans, slots, missing, key)
        # The scheduler keeps requests in their rows, so usually only the rows of requests that came
        # or went are copied; a request whose values were just computed is always copied.
        changed = sorted(set(_changed_rows(owners, entry.hoisted_for)) | set(missing))
        if changed:
            self._copy_hoisted(entry, changed, owners, [slot.hoisted[key] for slot in slots])
            entry.hoisted_for = owners

    def _copy_hoisted(self, entry: BucketGraph, rows: list[int], owners: list, values: list[list[torch.Tensor]]) -> None:
        """Each of `rows` of every hoisted buffer: its request's values (values[i]), or padding. On a
        GPU these are device copies queued behind the step; on a CPU, the host's memory traffic."""
        for j, (buffer, m) in enumerate(zip(entry.hoisted, entry.rows_per_request)):
            self._write_rows(buffer, m, entry.bucket, rows, owners, lambda i: values[i][j])
        self.counters.hoisted_rows_copied += sum(owners[i] is not None for i in rows)

    def _run_prologue(self, entry: BucketGraph, plans: list[WorkPlan], slots: list[RequestSlot], missing: list[int],
                      key: tuple) -> None:  # fmt: skip
        """Compute the hoisted values of the requests at `missing` (they have none) with the prologue of
        the smallest prepared bucket that holds them, so an arrival into a full batch costs a batch-1
        prologue, not a whole bucket's; each keeps them in its slot for every bucket it runs at."""
        source = self._prologue_source(entry, len(missing))
        if source.bucket == 1:  # one arrival: the prologue reads its own batch-1 tensors, copied nowhere
            rows, args = [0], self._own_args(source, plans[missing[0]])
        else:
            rows = missing if source is entry else self._constants_into_first_rows(source, plans, slots, missing)
            self._copy_prologue_constants(source, [plans[i] for i in missing], rows)
            args = source.base_args()
        values = source.compiled.prologue_fn(*args)
        self.counters.prologue_runs += 1
        # The prologue's outputs are fresh tensors, so each new request keeps views of its rows of them
        # as they are: no copy but the one into the static buffers. An output that aliases a static
        # buffer (a prologue passing an input through) is copied once.
        kept = [(v.clone() if v.untyped_storage().data_ptr() in source.storages else v).view(m, source.bucket, *v.shape[1:])
                for v, m in zip(values, source.rows_per_request)]  # fmt: skip
        for i, row in zip(missing, rows):
            slots[i].keep_hoisted(key, [k[:, row] for k in kept])

    def _constants_into_first_rows(self, source: BucketGraph, plans: list[WorkPlan], slots: list[RequestSlot],
                                   missing: list[int]) -> list[int]:  # fmt: skip
        """The constants the step reads of the requests at `missing` into the first rows of a smaller
        bucket's buffers (the rows its prologue computes them in); returns those rows."""
        owners = [*(slots[i] for i in missing), *source.input_owners[len(missing) :]]
        changed = _changed_rows(owners, source.input_owners)
        self._write_constants(source, changed, owners, lambda r: plans[missing[r]].inputs)
        source.input_owners = owners
        return list(range(len(missing)))

    def _copy_prologue_constants(self, source: BucketGraph, plans: list[WorkPlan], rows: list[int]) -> None:
        """The constants only the prologue reads (kept current nowhere) of `plans` into their `rows`."""
        for name, buffer in source.prologue_constants:
            for plan, row in zip(plans, rows):
                buffer[row : row + 1].copy_(plan.inputs[name])

    def _own_args(self, source: BucketGraph, plan: WorkPlan) -> list[torch.Tensor]:
        """A batch-1 prologue's arguments: the plan's own inputs, laid out as the buffers they stand
        for (each is [1, ...], as a bucket-1 buffer), so an arrival's texts (megabytes) are not copied
        into a buffer just to be read once. An input laid out otherwise goes through its buffer, and
        then that buffer's row no longer holds its owner's constants."""
        args = list(source.compiled.params)
        for name in source.compiled.input_names:
            own, buffer = plan.inputs[name], source.inputs[name]
            if own.shape == buffer.shape and own.stride() == buffer.stride() and own.dtype == buffer.dtype and own.device == buffer.device:
                args.append(own)
                continue
            buffer.copy_(own)
            source.input_owners = [_UNWRITTEN]
            args.append(buffer)
        return args

    def _prologue_source(self, entry: BucketGraph, count: int) -> BucketGraph:
        """The prepared graph of `entry`'s step at the smallest bucket of at least `count` rows whose
        hoisted values are kept under the same key (entry itself when none is smaller)."""
        smaller = [other for other in self._graphs.values() if count <= other.bucket < entry.bucket and other.values_key == entry.values_key]
        return min(smaller, key=lambda other: other.bucket, default=entry)

    def _write_constants(self, entry: BucketGraph, rows: list[int], owners: list, inputs_of) -> None:
        """Each request constant the step reads into `rows` of entry's buffers; inputs_of(i) is row i's
        request's inputs."""
        for name, buffer in entry.constants:
            self._write_rows(buffer, 1, entry.bucket, rows, owners, lambda i: inputs_of(i)[name])

    def _write_rows(self, buffer: torch.Tensor, m: int, bucket: int, rows: list[int], owners: list, value_of) -> None:
        """Write each of `rows` (m buffer rows per request, branch-major): value_of(i) for a request,
        pad_value for a padding row (owner None)."""
        view = buffer.view(m, bucket, *buffer.shape[1:])
        for i in rows:
            if owners[i] is None:
                view[:, i].fill_(self.pad_value if buffer.is_floating_point() else 0)
            else:
                view[:, i].copy_(value_of(i))

    def _replay(self, entry: BucketGraph) -> tuple[torch.Tensor, ...]:
        if entry.graph is None:
            return tuple(entry.compiled.step_fn(*entry.args))
        if self.debug:
            now = tuple(t.data_ptr() for t in entry.args)
            assert now == entry.addresses, "a static buffer moved since capture: the graph would read stale memory"
        entry.graph.replay()
        self.counters.replays += 1
        return entry.outputs


def _changed_rows(owners: list, previous: list) -> list[int]:
    """Rows whose owner (a request's RequestSlot, None for padding) is not the one they held."""
    return [i for i, (owner, before) in enumerate(zip(owners, previous)) if owner is not before]
