"""A ``torch.compile`` pass: collective + matmul patterns become ``torch.ops.ficco`` ops.

A tensor-parallel model written with PyTorch's functional collectives compiles to graphs
where an all-gather feeds a matmul and a matmul feeds a reduce-scatter or an all-reduce,
forward and backward. PyTorch's own async-TP pass (``micro_pipeline_tp``, NCCL with
symmetric memory only) fuses the first two into its fixed schedule. This pass finds the
same matches with PyTorch's own pattern finders (``find_all_gather_patterns``,
``find_reduce_scatter_patterns``) and replaces each with the ficco op
(``runtime/library.py``), which decides its schedule at run time per call shape from the
layer tables, as eager ``torch_ops`` calls do:

    from ficco_select.runtime.compile import install_pass
    with install_pass() as ficco_pass:      # Inductor's post_grad_custom_post_pass
        out = torch.compile(model)(x)       # compiled (and its backward) while installed
    for rewrite in ficco_pass.rewrites:     # each match, its layer, what was done
        print(rewrite)

What it matches and what it leaves:
- all-gather (any gather dim) + every ``mm`` consuming the gathered tensor (2-D, or
  reshape -> mm -> reshape, or a dim-0 gather flattened to 2-D rows by reshapes and then
  multiplied: DTensor's batch-1 sequence gather): one ``ficco::all_gather_matmul`` per
  all-gather, all its matmuls' weights together (the op concatenates them, one GEMM).
- ``mm`` + reduce-scatter (any scatter dim), where the matmul's only user is the
  reduce-scatter, or reshapes that regroup its rows for a dim-0 scatter (the gradient of a
  batch-1 sequence gather): ``ficco::matmul_reduce_scatter``.
- ``mm`` + all-reduce (``funcol.all_reduce``: ``all_reduce`` then ``wait_tensor`` in the
  graph), where the matmul's only user is the all-reduce: ``ficco::matmul_all_reduce``.
  An all-reduce *before* a matmul (the column-parallel input's gradient in some models)
  has no ficco op and is left alone.
- Scaled (fp8) matmuls are left to PyTorch.

It keeps the serial pattern (records it, rewrites nothing) where ficco would run
PyTorch's serial form anyway, so that a rewrite would add only the op's dispatch:
- the selector's layer table says the baseline at every m it covers (the table is built
  at compile time the way ``dispatch.prepare_layer`` builds it at a layer's first call, on
  the process's selector, ``configure``); a pinned schedule (``configure(schedule=...)``)
  rewrites every match;
- a gather along the contraction (last) dim, a reduce op other than sum/avg, a scatter
  extent or an all-reduce's row count the world size does not divide: ``torch_ops``
  itself runs PyTorch's implementation there.
A layer whose table cannot be built at compile time (symbolic k or n, a scatter along the
last dim: its table's m would be the weight's width) is rewritten: the op decides at run
time.

Choices a caller should know:
- The ops it inserts skip their per-call check that every rank passes the same shapes
  (``run_check=False``): the functional collectives they replace check nothing, and a
  compiled tensor-parallel job runs the same graph on every rank (SPMD), as they assume.
- No collective at compile time: each rank decides "keep serial" from its own selector,
  so every rank must ``configure`` the same selector and hardware (as a job does). A
  compile-time broadcast would hang the ranks wherever Inductor's cache lets some ranks
  skip compiling and not others.
- The pass bypasses Inductor's FX graph cache (``uuid()`` is None): its decisions depend
  on the selector, and a cache hit would skip the pass and leave its report empty.
- Install it before the first call of the compiled function: Inductor reads the setting
  when it compiles (forward at the first call, backward at the first backward).
- PyTorch's own async-TP pass (``torch._inductor.config._micro_pipeline_tp``) runs before
  this one; where it fused a match first, this pass sees nothing to rewrite there.
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
import torch._inductor.config as inductor_config
import torch.distributed as dist
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.fx_passes.micro_pipeline_tp import (
    _find_consumer_matmuls,
    _find_producer_matmul,
    _Matmul,
    find_all_gather_patterns,
    find_reduce_scatter_patterns,
)

from ficco_select.runtime import dispatch, library  # noqa: F401 - library registers torch.ops.ficco
from ficco_select.executor.operators import dtype_name
from ficco_select.executor.supports import (all_gather_matmul_unsupported, matmul_all_reduce_unsupported,
                                            matmul_reduce_scatter_unsupported)
from ficco_select.runtime.dispatch import resolve_group, scenario_for
from ficco_select.runtime.ops import TABLE_ROWS

__all__ = ["install_pass", "FiccoPass", "Rewrite"]

aten = torch.ops.aten
log = logging.getLogger("ficco_select.runtime.compile")
c10d = torch.ops._c10d_functional


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """One match the pass found: the ficco op it became, or why the serial pattern stayed."""

    op: str
    """``all_gather_matmul``, ``matmul_reduce_scatter`` or ``matmul_all_reduce``."""
    graph: str
    """``forward``, ``backward`` or ``inference``: the graph Inductor compiled it in."""
    rows: int | str
    """The GEMM's rows (the token count m; its expression where it is symbolic)."""
    n: int | str
    """The GEMM's output width on this rank."""
    k: int | str
    """The GEMM's contraction on this rank."""
    dtype: str
    world_size: int
    rewritten: bool
    """True: the ficco op decides at run time; False: the serial pattern was kept."""
    reason: str

    def line(self) -> str:
        what = "-> ficco" if self.rewritten else "kept serial"
        return (f"{self.op} ({self.graph}) m={self.rows} n={self.n} k={self.k} {self.dtype} "
                f"P={self.world_size}: {what} ({self.reason})")


class FiccoPass(CustomGraphPass):
    """Inductor's post-grad custom pass that rewrites the matches; ``rewrites`` is its report."""

    def __init__(self) -> None:
        self.rewrites: list[Rewrite] = []
        self._previous = None
        self._installed = False

    # -- installing ---------------------------------------------------------------------
    def install(self) -> FiccoPass:
        """Add this pass to ``torch._inductor.config.post_grad_custom_post_pass`` (after any
        pass already there)."""
        if self._installed:
            return self
        self._previous = inductor_config.post_grad_custom_post_pass
        if self._previous is None:
            inductor_config.post_grad_custom_post_pass = self
        elif isinstance(self._previous, (list, tuple)):
            inductor_config.post_grad_custom_post_pass = [*self._previous, self]
        else:
            inductor_config.post_grad_custom_post_pass = [self._previous, self]
        self._installed = True
        return self

    def remove(self) -> None:
        """Restore the setting as it was before ``install``."""
        if self._installed:
            inductor_config.post_grad_custom_post_pass = self._previous
            self._installed = False

    def __enter__(self) -> FiccoPass:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()

    def uuid(self) -> None:
        # None: Inductor bypasses its FX graph cache, so that the pass always runs (its
        # decisions depend on the selector, and its report on running).
        return None

    # -- the pass -------------------------------------------------------------------------
    def __call__(self, graph: torch.fx.Graph) -> None:
        kind = _graph_kind(graph)
        for match in find_all_gather_patterns(graph):
            self._all_gather_matmul(graph, match, kind)
        for match in find_reduce_scatter_patterns(graph):
            self._matmul_reduce_scatter(graph, match, kind)
        for wait in [n for n in graph.nodes if n.target is c10d.wait_tensor.default]:
            self._matmul_all_reduce(graph, wait, kind)

    def _record(self, rewrite: Rewrite) -> None:
        self.rewrites.append(rewrite)
        log.info("ficco-select compile pass: %s", rewrite.line())

    def _all_gather_matmul(self, graph, ag, kind: str) -> None:
        matmuls = [mm for mm in _find_consumer_matmuls(ag.res_node)
                   if type(mm) is _Matmul and ag.res_node not in mm.arg_ancestor_nodes]
        flat = _flattened(ag) if not matmuls else None
        if flat is not None:  # the gathered rows flattened to 2-D, then plain mm's of them
            matmuls = [mm for mm in _find_consumer_matmuls(flat[-1])
                       if type(mm) is _Matmul and len(mm.nodes) == 1 and mm.nodes[0].args[0] is flat[-1]
                       and flat[-1] not in mm.arg_ancestor_nodes]
        if not matmuls:
            return
        shard, P = _val(ag.shard_node), _world(ag.group_name)
        k, n = shard.shape[-1], sum(_val(mm.B_node).shape[-1] for mm in matmuls)
        unsupported = all_gather_matmul_unsupported(ag.gather_dim, shard.ndim, len(matmuls))
        rows = shard.numel() // k * (1 if unsupported else P) if k else 0
        if unsupported:
            keep, reason = True, f"{unsupported}: ficco would run PyTorch's implementation"
            k = P * k  # the GEMM's (a gather of the contraction dim)
        else:
            keep, reason = _serial_everywhere(n, k, lambda: scenario_for(
                "ag_gemm", P * TABLE_ROWS, P * n, k, shard.dtype, P, shard.device))
        self._record(_rewrite("all_gather_matmul", kind, rows, n, k, shard, P, keep, reason))
        if keep:
            return
        with graph.inserting_before(ag.ag_node):
            # Flattened: gather the shard's rows flattened the same way (the same rows, in the
            # same order: a dim-0 gather then a row-major flatten is a flatten then a dim-0 gather).
            shard_node = ag.shard_node if flat is None else _call(graph, aten.reshape.default,
                                                                  (ag.shard_node, [-1, k]))
            fused = _call(graph, torch.ops.ficco.all_gather_matmul.default,
                          (shard_node, [mm.B_node for mm in matmuls], ag.gather_dim, ag.group_name, False))
            A = _call(graph, operator.getitem, (fused, 0))
            outs = _call(graph, operator.getitem, (fused, 1))
            for i, mm in enumerate(matmuls):
                mm.replace_with(_call(graph, operator.getitem, (outs, i)))
                mm.erase()
            if flat is None:
                ag.replace_with(A)
            else:
                flat[-1].replace_all_uses_with(A)
                for node in reversed(flat):
                    graph.erase_node(node)
            ag.erase()
        _raise_ancestors(graph, fused, [x for mm in matmuls for x in mm.arg_ancestor_nodes])

    def _matmul_reduce_scatter(self, graph, rs, kind: str) -> None:
        regrouped = _regrouped(rs)
        source = regrouped[0].args[0] if regrouped else rs.input_node
        mm = _find_producer_matmul(source)
        if mm is None or type(mm) is not _Matmul or rs.wait_tensor_node in mm.arg_ancestor_nodes:
            return
        matched = rs.match.nodes if hasattr(rs.match, "nodes") else rs.match
        if any(user not in matched for user in rs.input_node.users):
            return  # the matmul's result is used elsewhere too: the fused op does not return it
        A, B, P = _val(mm.A_node), _val(mm.B_node), _world(rs.group_name)
        k, n = A.shape[-1], B.shape[-1]
        rows = A.numel() // k if k else 0
        dim = 0 if regrouped else rs.scatter_dim % A.ndim
        extent = rows if regrouped else n if dim == A.ndim - 1 else A.shape[dim]
        if regrouped and not all(map(_concrete, _val(rs.wait_tensor_node).shape)):
            keep, reason = True, "a scatter of regrouped rows with a symbolic shape: left to PyTorch"
        elif unsupported := matmul_reduce_scatter_unsupported(rs.reduce_op, extent if _concrete(extent) else None, P):
            keep, reason = True, f"{unsupported}: ficco would run PyTorch's implementation"
        elif dim == A.ndim - 1:
            keep, reason = False, "scatters the last dim: no layer table at compile time, decided per call"
        else:
            keep, reason = _serial_everywhere(n, k, lambda: scenario_for(
                "gemm_rs", P * TABLE_ROWS, n, P * k, A.dtype, P, A.device))
        self._record(_rewrite("matmul_reduce_scatter", kind, rows, n, k, A, P, keep, reason))
        if keep:
            return
        with graph.inserting_before(rs.wait_tensor_node):
            if regrouped:  # the matmul's rows, scattered along dim 0, in the wait's shape
                A_rows = _call(graph, aten.reshape.default, (mm.A_node, [-1, k]))
                fused = _call(graph, torch.ops.ficco.matmul_reduce_scatter.default,
                              (A_rows, mm.B_node, rs.reduce_op, 0, rs.group_name, False))
                result = _call(graph, aten.reshape.default, (fused, list(_val(rs.wait_tensor_node).shape)))
            else:
                fused = result = _call(graph, torch.ops.ficco.matmul_reduce_scatter.default,
                                       (mm.A_node, mm.B_node, rs.reduce_op, rs.scatter_dim, rs.group_name, False))
            rs.replace_with(result)
            rs.erase()
            for node in reversed(regrouped or []):
                graph.erase_node(node)
            mm.erase()
        _raise_ancestors(graph, fused, mm.arg_ancestor_nodes)

    def _matmul_all_reduce(self, graph, wait, kind: str) -> None:
        ar = wait.args[0]
        if not (isinstance(ar, torch.fx.Node) and ar.target is c10d.all_reduce.default):
            return
        source, reduce_op, group_name = ar.args[:3]
        mm = _find_producer_matmul(source) if isinstance(source, torch.fx.Node) else None
        if mm is None or type(mm) is not _Matmul or wait in mm.arg_ancestor_nodes:
            return
        if set(source.users) != {ar} or any(u is not wait and u.op != "output" for u in ar.users):
            return  # the matmul's result (or the all-reduce's, unwaited) is used elsewhere
        A, B, P = _val(mm.A_node), _val(mm.B_node), _world(group_name)
        k, n = A.shape[-1], B.shape[-1]
        rows = A.numel() // k if k else 0
        if unsupported := matmul_all_reduce_unsupported(reduce_op, rows if _concrete(rows) else None, P):
            keep, reason = True, f"{unsupported}: ficco would run PyTorch's implementation"
        else:
            keep, reason = _serial_everywhere(n, k, lambda: scenario_for(
                "gemm_ar", P * TABLE_ROWS, n, P * k, A.dtype, P, A.device))
        self._record(_rewrite("matmul_all_reduce", kind, rows, n, k, A, P, keep, reason))
        if keep:
            return
        with graph.inserting_before(wait):
            fused = _call(graph, torch.ops.ficco.matmul_all_reduce.default, (mm.A_node, mm.B_node, reduce_op,
                                                                              group_name, False))
        wait.replace_all_uses_with(fused)
        for user in list(ar.users):
            if user.op == "output":  # the all-reduce's result saved for backward
                user.replace_input_with(ar, fused)
        graph.erase_node(wait)
        graph.erase_node(ar)
        mm.erase()
        _raise_ancestors(graph, fused, mm.arg_ancestor_nodes)


def install_pass() -> FiccoPass:
    """Install ficco's compile pass now (``FiccoPass.install``); the returned pass is also a
    context manager that removes it on exit, and its ``rewrites`` say what it did."""
    return FiccoPass().install()


# -- deciding at compile time -----------------------------------------------------------------
def _serial_everywhere(n, k, make_scenario) -> tuple[bool, str]:
    """(keep the serial pattern, why): True where the layer's table says the baseline at
    every m it covers. Built on this rank's selector, with no collective (see the module)."""
    if dispatch.pinned_schedule() is not None:
        return False, f"pinned schedule {dispatch.pinned_schedule().name}"
    if not (_concrete(n) and _concrete(k)):
        return False, "symbolic k or n: no layer table at compile time, decided per call"
    try:
        table = dispatch.selector().layer_table(make_scenario())
    except Exception as e:  # noqa: BLE001 - no table: the op decides per call at run time
        return False, f"no layer table ({type(e).__name__}: {e}): decided per call"
    if table is None:
        return False, "no layer table: decided per call"
    overlapped = sorted({d.schedule.name for d in table.decisions if d.schedule.granularity != "none"})
    span = f"m in [{table.grid[0]}, {table.grid[-1]}]"
    if not overlapped:
        return True, f"the layer table says baseline at every {span}"
    return False, f"the layer table overlaps somewhere in {span} ({', '.join(overlapped)})"


def _rewrite(op: str, kind: str, rows, n, k, like: torch.Tensor, P: int, keep: bool, reason: str) -> Rewrite:
    plain = lambda v: int(v) if _concrete(v) else str(v)  # noqa: E731
    return Rewrite(op=op, graph=kind, rows=plain(rows), n=plain(n), k=plain(k),
                   dtype=dtype_name(like.dtype), world_size=P,
                   rewritten=not keep, reason=reason)


# -- graph plumbing -----------------------------------------------------------------------------
def _graph_kind(graph: torch.fx.Graph) -> str:
    names = [n.name for n in graph.nodes if n.op == "placeholder"]
    if any(name.startswith("tangents") for name in names):
        return "backward"
    return "forward" if any(name.startswith("primals") for name in names) else "inference"


def _val(node: torch.fx.Node) -> torch.Tensor:
    return node.meta["val"]


def _flattened(ag) -> list[torch.fx.Node] | None:
    """The reshapes that flatten a dim-0 all-gather's result to 2-D rows (its last dim
    kept), each the only user of the one before, or None. DTensor writes a batch-1 sequence
    gather so: all-gather along dim 0, reshape to (1, seq, k), reshape to (seq, k), mm."""
    if ag.gather_dim != 0:
        return None
    node, chain, k = ag.res_node, [], _val(ag.res_node).shape[-1]
    while len(node.users) == 1:
        (user,) = node.users
        if user.target is not aten.reshape.default or user.args[0] is not node or _val(user).shape[-1] != k:
            return None
        chain.append(user)
        if _val(user).ndim == 2:
            return chain
        node = user
    return None


def _regrouped(rs) -> list[torch.fx.Node] | None:
    """The reshapes between a matmul and a dim-0 reduce-scatter of its rows regrouped (last
    dim kept), each the only user of the one before, or None. Autograd writes the gradient
    of a batch-1 sequence gather so: mm, reshape to (1, seq, k), reshape to (P, seq / P, k),
    reduce-scatter along dim 0. A row-major reshape keeps the rows' order, so that is the
    matmul's rows scattered along dim 0."""
    if rs.scatter_dim != 0:
        return None
    node, chain = rs.input_node, []
    while (node.target is aten.reshape.default and len(node.users) == 1
           and _val(node).shape[-1] == _val(node.args[0]).shape[-1]):
        chain.insert(0, node)
        source = node.args[0]
        if _find_producer_matmul(source) is not None:
            return chain if len(source.users) == 1 else None
        node = source
    return None


def _world(group_name: str) -> int:
    return dist.get_world_size(resolve_group(group_name))


def _concrete(v) -> bool:
    """Whether a size is a plain int (a SymInt is symbolic: comparing it would add a guard)."""
    return isinstance(v, int)


def _call(graph: torch.fx.Graph, target, args: tuple) -> torch.fx.Node:
    """A new call node with its fake value (``meta['val']``), as Inductor's lowering reads it."""
    node = graph.call_function(target, args=args)
    fake_args = torch.fx.node.map_arg(args, lambda a: a.meta["val"])
    fake_mode = torch._guards.detect_fake_mode(torch.utils._pytree.tree_leaves(fake_args))
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = target(*fake_args)
    else:
        node.meta["val"] = target(*fake_args)
    return node


def _raise_ancestors(graph: torch.fx.Graph, fused: torch.fx.Node, ancestors) -> None:
    """Move the weights' producers that come after the fused node before it (as PyTorch's
    async-TP pass does: the fused node sits where the collective was)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in sorted(set(ancestors), key=lambda x: order[x]):
        if order[node] > order[fused]:
            fused.prepend(node)
