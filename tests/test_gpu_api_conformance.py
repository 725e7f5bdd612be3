"""The GPU-only code calls torch APIs that exist in the pinned torch, with arguments they accept.

The CUDA and NCCL paths (``executor/cuda.py``, ``executor/peer.py``, the GPU profiler, the
node measurement) never run on a CPU machine, so a renamed or re-signatured torch API would
only show up on a GPU. This test reads those files with ``ast`` and checks, by introspection
only (no CUDA call runs), every call into ``torch.cuda``, ``torch.distributed`` (including
``_symmetric_memory``) and ``torch.ops.symm_mem``, every method called on an object whose
type the code makes plain (a ``torch.cuda.Event`` / ``Stream`` / symmetric-memory handle,
``Tensor.record_stream``), and every other reference into those namespaces (``dist.Store``,
``dist.group.WORLD``, annotations):

- the dotted name must resolve on the installed torch (submodules imported as needed);
- the call's positional count and keyword names must bind to the callee's signature
  (``inspect.signature``; for C++ bindings the signature lines of the docstring; for
  ``torch.ops`` the op schema). A call with ``*args`` / ``**kwargs`` binds partially: the
  explicit arguments must still fit.

Nothing is hand-listed: the calls are collected from the source each run, each one is a
test case (``file:line:col:name``), a count check makes sure the collection finds the calls
(so it cannot silently check nothing) and a negative check proves the checker fails on
misspelled names and wrong keywords.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

# File -> least number of checked items (calls + method calls + references) it must yield.
# A little below the current counts: a failure here means the collector lost track of the
# code (or the code moved), not that the code is wrong.
MIN_ITEMS = {
    "ficco_select/executor/cuda.py": 25,  # 28 now
    "ficco_select/executor/peer.py": 35,  # 39 now
    "ficco_select/executor/comm.py": 8,  # 9 now
    "data/gpu_profile/copies.py": 10,  # 11 now
    "data/gpu_profile/gemm.py": 0,  # no GPU-specific call: times through timing.time_gpu
    "data/gpu_profile/read.py": 0,  # reads JSON only
    "data/gpu_profile/realized.py": 0,  # no GPU-specific call: loopback + timing do it
    "data/gpu_profile/run.py": 7,  # 8 now
    "data/gpu_profile/runner.py": 3,  # 3 now
    "data/gpu_profile/timing.py": 9,  # 10 now
    "data/gpu_profile/__init__.py": 0,
    "data/measure/loopback.py": 0,  # CUDA goes through cuda.CudaLanes
    "data/measure/node.py": 7,  # 8 now
}
# The least number of *calls* (functions and methods, not plain references) per file.
MIN_CALLS = {
    "ficco_select/executor/cuda.py": 21,  # 24 now (14 torch.cuda.* calls, 10 Event/Stream/Tensor methods)
    "ficco_select/executor/peer.py": 25,  # 28 now
    "ficco_select/executor/comm.py": 3,  # 4 now (transfers are posted on the group object itself)
    "data/gpu_profile/copies.py": 9,  # 11 now
    "data/gpu_profile/run.py": 5,  # 6 now
    "data/gpu_profile/runner.py": 3,  # 3 now
    "data/gpu_profile/timing.py": 6,  # 7 now
    "data/measure/node.py": 5,  # 6 now
}


def target_files() -> list[str]:
    """The GPU-only files: fixed ones plus every module of data/gpu_profile (new ones too)."""
    files = {"ficco_select/executor/cuda.py", "ficco_select/executor/peer.py", "ficco_select/executor/comm.py",
             "data/measure/loopback.py", "data/measure/node.py"}
    files |= {p.relative_to(ROOT).as_posix() for p in (ROOT / "data" / "gpu_profile").glob("*.py")}
    return sorted(files)


# -- which torch names count as GPU API -----------------------------------------------------------
GPU_PREFIXES = ("torch.cuda", "torch.distributed", "torch.ops.symm_mem", "torch.backends.cuda",
                "torch.backends.cudnn", "torch.version.cuda", "torch._C._distributed_c10d")
TENSOR_GPU_METHODS = frozenset({"record_stream"})
"""Tensor methods that are about CUDA streams (other tensor methods are out of scope)."""


def is_gpu_name(dotted: str) -> bool:
    return any(dotted == p or dotted.startswith(p + ".") for p in GPU_PREFIXES)


def is_gpu_class(cls: type) -> bool:
    module = getattr(cls, "__module__", "") or ""
    return is_gpu_name(module) or issubclass(cls, (torch.Stream, torch.Event))


# -- resolving names on the installed torch -------------------------------------------------------
class Missing(Exception):
    pass


def resolve_torch(dotted: str) -> Any:
    """The object `dotted` (rooted at ``torch``) names; submodules are imported on the way."""
    parts = dotted.split(".")
    if parts[0] != "torch":
        raise Missing(f"{dotted}: not rooted at torch")
    if parts[:2] == ["torch", "ops"] and len(parts) > 2 and parts[2] == "symm_mem":
        importlib.import_module("torch.distributed._symmetric_memory")  # registers the Python-side ops
    obj: Any = torch
    for i, part in enumerate(parts[1:], start=1):
        try:
            obj = getattr(obj, part)
            continue
        except Exception:  # AttributeError, or RuntimeError from torch.ops namespaces
            pass
        if isinstance(obj, types.ModuleType):
            try:
                obj = importlib.import_module(".".join(parts[:i + 1]))
                continue
            except ImportError:
                pass
        raise Missing(f"{'.'.join(parts[:i + 1])} does not exist in torch {torch.__version__}")
    return obj


def resolve_annotation(ann: Any, globalns: dict) -> Any:
    """A return annotation (possibly a string) as an object, or None."""
    if isinstance(ann, str):
        try:
            return eval(ann, dict(globalns))  # noqa: S307 - torch's own annotation text
        except Exception:
            return None
    return None if ann is inspect.Signature.empty else ann


def return_class(fn: Any) -> type | None:
    """What calling `fn` gives, when torch says so: the class itself, or its return annotation."""
    if isinstance(fn, type):
        return fn
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    ann = resolve_annotation(sig.return_annotation, getattr(fn, "__globals__", {}))
    return ann if isinstance(ann, type) else None


# -- signatures ---------------------------------------------------------------------------------------
_PLACEHOLDER = object()


def _split_top(text: str) -> list[str]:
    """Split at commas that are not inside brackets or quotes."""
    out, depth, cur, quote = [], 0, [], None
    for ch in text:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = None
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur))
    return [s.strip() for s in out if s.strip()]


def _has_top_level_equals(piece: str) -> bool:
    depth = 0
    for i, ch in enumerate(piece):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "=" and depth == 0 and piece[i - 1:i] not in ("!", "<", ">", "=") and piece[i + 1:i + 2] != "=":
            return True
    return False


def signature_from_text(params: str, drop_self: bool) -> inspect.Signature:
    """A Signature from a pybind / docstring parameter list ``a: int, b: int = 0, *, c=1``."""
    P = inspect.Parameter
    kind, out = P.POSITIONAL_OR_KEYWORD, []
    for piece in _split_top(params):
        if piece == "*":
            kind = P.KEYWORD_ONLY
            continue
        if piece == "/":
            out = [p.replace(kind=P.POSITIONAL_ONLY) for p in out]
            continue
        if piece.startswith("**"):
            out.append(P(re.match(r"\*\*(\w+)", piece).group(1), P.VAR_KEYWORD))
            continue
        if piece.startswith("*"):
            out.append(P(re.match(r"\*(\w+)", piece).group(1), P.VAR_POSITIONAL))
            kind = P.KEYWORD_ONLY
            continue
        name = re.match(r"[A-Za-z_]\w*", piece)
        if name is None:
            raise ValueError(f"cannot read parameter {piece!r}")
        default = _PLACEHOLDER if _has_top_level_equals(piece) else P.empty
        out.append(P(name.group(0), kind, default=default))
    if drop_self and out and out[0].name == "self":
        out = out[1:]
    return inspect.Signature(out, __validate_parameters__=False)


def signatures_from_doc(fn: Any, name: str, drop_self: bool) -> list[inspect.Signature]:
    """Signature lines ``name(...)`` of a C++ binding's docstring (several when overloaded)."""
    doc = getattr(fn, "__doc__", None) or ""
    sigs = []
    for m in re.finditer(rf"^\s*(?:\d+\.\s*)?{re.escape(name)}\((.*)\)\s*(?:->.*)?$", doc, re.MULTILINE):
        try:
            sigs.append(signature_from_text(m.group(1), drop_self))
        except ValueError:
            pass
    return sigs


def signatures_from_schema(packet: Any) -> list[inspect.Signature]:
    """One Signature per overload of a ``torch.ops`` op, from its schema."""
    P, sigs = inspect.Parameter, []
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        params = [P(a.name, P.KEYWORD_ONLY if a.kwarg_only else P.POSITIONAL_OR_KEYWORD,
                    default=_PLACEHOLDER if a.has_default_value() else P.empty) for a in schema.arguments]
        sigs.append(inspect.Signature(params, __validate_parameters__=False))
    return sigs


def callee_signatures(obj: Any, name: str, *, bound_method_of: type | None = None) -> tuple[list[inspect.Signature], str]:
    """(signatures the call must bind to one of, how they were read). Empty: unreadable.

    bound_method_of: `obj` was looked up on this class and is called on an instance, so
    its `self` is supplied and must not be counted among the call's arguments.
    """
    if isinstance(obj, torch._ops.OpOverloadPacket):
        return signatures_from_schema(obj), "schema"
    if isinstance(obj, torch._ops.OpOverload):
        return signatures_from_schema_one(obj), "schema"
    takes_self = False
    if bound_method_of is not None:
        static = inspect.getattr_static(bound_method_of, name, None)
        takes_self = not isinstance(static, (staticmethod, classmethod))
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        sig = None
    if sig is not None:
        params = list(sig.parameters.values())
        if takes_self and inspect.isfunction(obj) and params:
            sig = sig.replace(parameters=params[1:])
        elif takes_self and not inspect.isfunction(obj) and params and params[0].name == "self":
            sig = sig.replace(parameters=params[1:])
        return [sig], "inspect"
    sigs = signatures_from_doc(obj, name, drop_self=takes_self)
    if not sigs and isinstance(obj, type):
        sigs = signatures_from_doc(obj.__init__, "__init__", drop_self=True)
    return sigs, "docstring" if sigs else "unreadable"


def signatures_from_schema_one(op: Any) -> list[inspect.Signature]:
    P = inspect.Parameter
    return [inspect.Signature([P(a.name, P.KEYWORD_ONLY if a.kwarg_only else P.POSITIONAL_OR_KEYWORD,
                                 default=_PLACEHOLDER if a.has_default_value() else P.empty)
                               for a in op._schema.arguments], __validate_parameters__=False)]


# -- collecting the calls from source ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Use:
    """One use of a GPU API in the source."""

    file: str
    line: int
    col: int
    name: str  # dotted: torch.cuda.Event, or torch.cuda.streams.Stream.wait_event for a method
    kind: str  # "call" | "method" | "ref"
    n_positional: int = 0
    keywords: tuple[str, ...] = ()
    star_args: bool = False
    star_kwargs: bool = False
    receiver: type | None = dataclasses.field(default=None, compare=False)
    method: str = ""

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}:{self.col}:{self.name}"

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


# Inferred types: ("cls", real class) | ("local", class name in the file) | ("seq", inner) | None
Ty = tuple | None


def _merge(a: Ty, b: Ty, seen: bool) -> tuple[Ty, bool]:
    """Flow-insensitive: a name keeps a type only while every assignment agrees."""
    if not seen:
        return b, True
    return (a if a == b else None), True


class _Scope:
    def __init__(self, aliases: dict[str, str], env: dict[str, Ty], cls: str | None):
        self.aliases, self.env, self.cls = aliases, env, cls


class Collector:
    """Walks one file; yields the GPU API uses it finds."""

    def __init__(self, source: str, file: str):
        self.tree = ast.parse(source)
        self.file = file
        self.local_classes = {n.name for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)}
        self.class_attrs: dict[str, dict[str, Ty]] = {c: {} for c in self.local_classes}
        self.uses: list[Use] = []

    # aliases -----------------------------------------------------------------------------------
    @staticmethod
    def _own_statements(body: list[ast.stmt]) -> Iterator[ast.AST]:
        """Nodes of a body, not descending into nested functions or classes."""
        stack = list(body)
        while stack:
            node = stack.pop()
            yield node
            for child in ast.iter_child_nodes(node):
                if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                    stack.append(child)

    def _imports(self, body: list[ast.stmt], aliases: dict[str, str]) -> dict[str, str]:
        aliases = dict(aliases)
        for node in self._own_statements(body):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "torch" or a.name.startswith("torch."):
                        if a.asname:
                            aliases[a.asname] = a.name
                        else:
                            aliases["torch"] = "torch"
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "torch" or node.module.startswith("torch."):
                    for a in node.names:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        # `name = torch.x.y` (a plain alias of a torch attribute)
        for node in self._own_statements(body):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                dotted = self.dotted(node.value, aliases)
                if dotted and isinstance(node.value, (ast.Attribute, ast.Name)):
                    aliases[node.targets[0].id] = dotted
        return aliases

    @staticmethod
    def dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
        """`a.b.c` with `a` a torch alias -> the full dotted name; None otherwise."""
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in aliases:
            return None
        return ".".join([aliases[node.id], *reversed(parts)])

    # types -------------------------------------------------------------------------------------
    def ann_type(self, node: ast.AST | None, scope: _Scope) -> Ty:
        if node is None:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                return self.ann_type(ast.parse(node.value, mode="eval").body, scope)
            except SyntaxError:
                return None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            sides = [s for s in (node.left, node.right) if not (isinstance(s, ast.Constant) and s.value is None)]
            return self.ann_type(sides[0], scope) if len(sides) == 1 else None
        if isinstance(node, ast.Subscript):
            base = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
            if base in ("Sequence", "list", "List", "Iterable", "tuple", "MutableSequence"):
                inner = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) else node.slice
                t = self.ann_type(inner, scope)
                return ("seq", t) if t else None
            if base == "Optional":
                return self.ann_type(node.slice, scope)
            return None
        if isinstance(node, ast.Name) and node.id in self.local_classes:
            return ("local", node.id)
        dotted = self.dotted(node, scope.aliases)
        if dotted:
            try:
                obj = resolve_torch(dotted)
            except Missing:
                return None
            return ("cls", obj) if isinstance(obj, type) else None
        return None

    def expr_type(self, node: ast.AST, scope: _Scope) -> Ty:
        if isinstance(node, ast.Name):
            return scope.env.get(node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and scope.cls:
                return self.class_attrs.get(scope.cls, {}).get(node.attr)
            owner = self.expr_type(node.value, scope)
            if owner and owner[0] == "local":
                return self.class_attrs.get(owner[1], {}).get(node.attr)
            return None
        if isinstance(node, ast.Subscript):
            t = self.expr_type(node.value, scope)
            return t[1] if t and t[0] == "seq" else None
        if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            t = self.expr_type(node.elt, scope)
            return ("seq", t) if t else None
        if isinstance(node, ast.DictComp):
            t = self.expr_type(node.value, scope)
            return ("seq", t) if t else None
        if isinstance(node, ast.List) and node.elts:
            ts = {self.expr_type(e, scope) for e in node.elts}
            return ("seq", ts.pop()) if len(ts) == 1 and None not in ts else None
        if isinstance(node, ast.IfExp):
            sides = [s for s in (node.body, node.orelse) if not (isinstance(s, ast.Constant) and s.value is None)]
            ts = {self.expr_type(s, scope) for s in sides}
            return ts.pop() if len(ts) == 1 else None
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id in self.local_classes:
                return ("local", node.func.id)
            dotted = self.dotted(node.func, scope.aliases)
            if dotted:
                try:
                    cls = return_class(resolve_torch(dotted))
                except Missing:
                    return None
                return ("cls", cls) if cls else None
            if isinstance(node.func, ast.Attribute):
                recv = self.expr_type(node.func.value, scope)
                if recv and recv[0] == "cls":
                    method = getattr(recv[1], node.func.attr, None)
                    cls = return_class(method) if method is not None else None
                    return ("cls", cls) if cls else None
        return None

    # walking -------------------------------------------------------------------------------------
    def _assignments(self, body: list[ast.stmt], scope: _Scope) -> tuple[dict[str, Ty], dict[str, Ty]]:
        """(local names, self attributes) -> their types, from this body's assignments."""
        env: dict[str, Ty] = {}
        attrs: dict[str, Ty] = {}
        seen_env: set[str] = set()
        seen_attr: set[str] = set()

        def assign(target: ast.AST, t: Ty) -> None:
            if isinstance(target, ast.Name):
                env[target.id], _ = _merge(env.get(target.id), t, target.id in seen_env)
                seen_env.add(target.id)
            elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                  and target.value.id == "self" and scope.cls):
                attrs[target.attr], _ = _merge(attrs.get(target.attr), t, target.attr in seen_attr)
                seen_attr.add(target.attr)

        def bind(target: ast.AST, value: ast.AST | None, t: Ty) -> None:
            if isinstance(target, (ast.Tuple, ast.List)):
                values = value.elts if isinstance(value, (ast.Tuple, ast.List)) else None
                for i, sub in enumerate(target.elts):
                    if values is not None and len(values) == len(target.elts):
                        bind(sub, values[i], self.expr_type(values[i], scope))
                    else:
                        bind(sub, None, None)
            else:
                assign(target, t)

        for node in self._own_statements(body):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    bind(target, node.value, self.expr_type(node.value, scope))
            elif isinstance(node, ast.AnnAssign):
                t = self.ann_type(node.annotation, scope) or (
                    self.expr_type(node.value, scope) if node.value is not None else None)
                assign(node.target, t)
            elif isinstance(node, (ast.For, ast.AsyncFor)):
                it = self.expr_type(node.iter, scope)
                bind(node.target, None, it[1] if it and it[0] == "seq" else None)
            elif isinstance(node, (ast.With, ast.AsyncWith)):
                for item in node.items:
                    if item.optional_vars is not None:
                        bind(item.optional_vars, None, None)
        return env, attrs

    def _function_scope(self, fn: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, outer: _Scope,
                        cls: str | None) -> _Scope:
        body = fn.body if isinstance(fn.body, list) else [ast.Expr(fn.body)]
        aliases = self._imports(body, outer.aliases)
        scope = _Scope(aliases, dict(outer.env), cls)
        args = fn.args
        for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
            scope.env[a.arg] = self.ann_type(a.annotation, scope)
        for _ in range(2):  # names typed from names assigned earlier or later in the body
            env, _attrs = self._assignments(body, scope)
            scope.env.update(env)
        return scope

    def _learn_attrs(self) -> None:
        """Types of `self.x` per class, from every method (two rounds: classes refer to each other)."""
        module = _Scope(self._imports(self.tree.body, {}), {}, None)
        for _ in range(2):
            for cls in (n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)):
                merged: dict[str, Ty] = {}
                seen: set[str] = set()
                for fn in cls.body:
                    if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        scope = self._function_scope(fn, module, cls.name)
                        _env, attrs = self._assignments(fn.body, scope)
                        for k, t in attrs.items():
                            merged[k], _ = _merge(merged.get(k), t, k in seen)
                            seen.add(k)
                self.class_attrs[cls.name] = merged

    def collect(self) -> list[Use]:
        self._learn_attrs()
        module = _Scope(self._imports(self.tree.body, {}), {}, None)
        env, _ = self._assignments(self.tree.body, module)
        module.env.update(env)
        self._visit_body(self.tree.body, module)
        return sorted(set(self.uses), key=lambda u: (u.line, u.col, u.name))

    def _visit_body(self, nodes: list[ast.AST], scope: _Scope) -> None:
        for node in nodes:
            self._visit(node, scope)

    def _visit(self, node: ast.AST, scope: _Scope) -> None:
        if isinstance(node, ast.ClassDef):
            for dec in node.decorator_list:
                self._visit(dec, scope)
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self._visit_function(stmt, scope, node.name)
                else:
                    self._visit(stmt, _Scope(scope.aliases, scope.env, node.name))
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            self._visit_function(node, scope, scope.cls)
            return
        if isinstance(node, ast.Call):
            self._record_call(node, scope)
        elif isinstance(node, ast.Attribute):
            self._record_ref(node, scope)
            if self.dotted(node, scope.aliases):
                return  # a torch chain: its inner links are not separate uses
        for child in ast.iter_child_nodes(node):
            self._visit(child, scope)

    def _visit_function(self, fn: Any, outer: _Scope, cls: str | None) -> None:
        if not isinstance(fn, ast.Lambda):
            for dec in fn.decorator_list:
                self._visit(dec, outer)
        for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]:
            if a.annotation is not None:
                self._visit(a.annotation, outer)
        for d in [*fn.args.defaults, *fn.args.kw_defaults]:
            if d is not None:
                self._visit(d, outer)
        if not isinstance(fn, ast.Lambda) and fn.returns is not None:
            self._visit(fn.returns, outer)
        scope = self._function_scope(fn, outer, cls)
        self._visit_body(fn.body if isinstance(fn.body, list) else [fn.body], scope)

    def _call_shape(self, call: ast.Call) -> dict[str, Any]:
        return dict(n_positional=sum(not isinstance(a, ast.Starred) for a in call.args),
                    keywords=tuple(k.arg for k in call.keywords if k.arg is not None),
                    star_args=any(isinstance(a, ast.Starred) for a in call.args),
                    star_kwargs=any(k.arg is None for k in call.keywords))

    def _record_call(self, call: ast.Call, scope: _Scope) -> None:
        dotted = self.dotted(call.func, scope.aliases)
        if dotted:
            if dotted.startswith("torch") and is_gpu_name(dotted):
                self.uses.append(Use(self.file, call.lineno, call.col_offset, dotted, "call", **self._call_shape(call)))
            return
        if isinstance(call.func, ast.Attribute):
            recv = self.expr_type(call.func.value, scope)
            if recv and recv[0] == "cls" and isinstance(recv[1], type):
                cls, name = recv[1], call.func.attr
                if is_gpu_class(cls) or (issubclass(cls, torch.Tensor) and name in TENSOR_GPU_METHODS):
                    self.uses.append(Use(self.file, call.lineno, call.col_offset,
                                         f"{cls.__module__}.{cls.__qualname__}.{name}", "method",
                                         receiver=cls, method=name, **self._call_shape(call)))

    def _record_ref(self, node: ast.Attribute, scope: _Scope) -> None:
        dotted = self.dotted(node, scope.aliases)
        if dotted and dotted.startswith("torch") and is_gpu_name(dotted):
            self.uses.append(Use(self.file, node.lineno, node.col_offset, dotted, "ref"))


def collect_source(source: str, file: str = "<string>") -> list[Use]:
    """GPU API uses of a source text. A call's function chain is a "call", never also a "ref"."""
    uses = Collector(source, file).collect()
    calls = {(u.line, u.col) for u in uses if u.kind == "call"}
    return [u for u in uses if not (u.kind == "ref" and (u.line, u.col) in calls)]


def collect_file(rel: str) -> list[Use]:
    return collect_source((ROOT / rel).read_text(), rel)


# -- checking ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Verdict:
    problems: list[str]
    how: str  # "inspect" | "docstring" | "schema" | "unreadable" | "exists" (refs) | "missing"


def check(use: Use) -> Verdict:
    """Does `use` fit the installed torch? Problems name file:line and the dotted name."""
    here = f"{use.where}: {use.name}"
    if use.kind == "method":
        if not hasattr(use.receiver, use.method):
            return Verdict([f"{here}: {use.receiver.__qualname__} has no method {use.method!r} "
                            f"in torch {torch.__version__}"], "missing")
        obj = getattr(use.receiver, use.method)
        sigs, how = callee_signatures(obj, use.method, bound_method_of=use.receiver)
    else:
        try:
            obj = resolve_torch(use.name)
        except Missing as e:
            return Verdict([f"{use.where}: {e}"], "missing")
        if use.kind == "ref":
            return Verdict([], "exists")
        if not callable(obj):
            return Verdict([f"{here}: is called but is a {type(obj).__name__}, not callable"], "inspect")
        sigs, how = callee_signatures(obj, use.name.rsplit(".", 1)[-1])
    if not sigs:
        return Verdict([], how)
    args = [_PLACEHOLDER] * use.n_positional
    kwargs = dict.fromkeys(use.keywords, _PLACEHOLDER)
    partial = use.star_args or use.star_kwargs
    errors = []
    for sig in sigs:
        try:
            (sig.bind_partial if partial else sig.bind)(*args, **kwargs)
            return Verdict([], how)
        except TypeError as e:
            errors.append(f"{sig}: {e}")
    shape = ", ".join(["_"] * use.n_positional + [f"{k}=_" for k in use.keywords]
                      + (["*args"] if use.star_args else []) + (["**kwargs"] if use.star_kwargs else []))
    return Verdict([f"{here}({shape}) does not fit torch {torch.__version__} ({how}): " + " | ".join(errors)], how)


# -- the tests -------------------------------------------------------------------------------------------
USES_BY_FILE = {rel: collect_file(rel) for rel in target_files()}
ALL_USES = [u for uses in USES_BY_FILE.values() for u in uses]


@pytest.mark.parametrize("use", ALL_USES, ids=[u.id for u in ALL_USES])
def test_gpu_api_use_fits_installed_torch(use: Use) -> None:
    verdict = check(use)
    assert not verdict.problems, "\n".join(verdict.problems)


def test_collection_finds_the_calls() -> None:
    assert set(MIN_ITEMS) <= set(USES_BY_FILE), f"files gone: {sorted(set(MIN_ITEMS) - set(USES_BY_FILE))}"
    short = []
    for rel, uses in USES_BY_FILE.items():
        calls = [u for u in uses if u.kind != "ref"]
        if len(uses) < MIN_ITEMS.get(rel, 0) or len(calls) < MIN_CALLS.get(rel, 0):
            short.append(f"{rel}: {len(uses)} uses ({len(calls)} calls), expected at least "
                         f"{MIN_ITEMS.get(rel, 0)} ({MIN_CALLS.get(rel, 0)} calls)")
    assert not short, "\n".join(short)
    # The kinds of use the GPU code relies on are all found (a collector regression shows here).
    names = {u.name for u in ALL_USES}
    for expected in ("torch.cuda.Event", "torch.cuda.Stream", "torch.cuda.stream", "torch.cuda.current_stream",
                     "torch.cuda.synchronize", "torch.distributed.P2POp", "torch.distributed.batch_isend_irecv",
                     "torch.distributed.init_process_group", "torch.distributed._symmetric_memory.rendezvous",
                     "torch.distributed._symmetric_memory.empty"):
        assert expected in names, f"no use of {expected} collected"
    methods = {u.method for u in ALL_USES if u.kind == "method"}
    assert {"record", "wait_event", "elapsed_time", "synchronize", "get_buffer", "wait_signal",
            "put_signal", "record_stream"} <= methods, methods
    # Most calls are checked against a real signature, not for existence only.
    calls = [u for u in ALL_USES if u.kind != "ref"]
    unreadable = [u.id for u in calls if check(u).how == "unreadable"]
    assert len(unreadable) <= len(calls) // 10, f"signatures unreadable for: {unreadable}"


BAD_SOURCE = '''
import torch
import torch.distributed as dist
from torch.cuda import Event as CudaEvent

def f(buf, group, t: torch.Tensor):
    import torch.distributed._symmetric_memory as symm_mem
    a = torch.cuda.Evnt(enable_timing=True)                   # 8: misspelled class
    b = torch.cuda.Event(enable_timng=True)                    # 9: wrong keyword
    c = CudaEvent(True, False, False, False, False)            # 10: too many positionals
    c.recrod()                                                 # 11: misspelled method
    s = torch.cuda.Stream()
    s.wait_event(c, blocking=True)                             # 13: wrong method keyword
    h = symm_mem.rendezvuos(buf, group)                        # 14: misspelled function
    h2 = symm_mem.rendezvous(buf, group)
    h2.wait_signal(0, chanel=1, timeout_ms=5)                  # 16: wrong keyword (pybind)
    torch.ops.symm_mem.one_shot_all_reduce(t, "sum", grp="0")  # 17: wrong keyword (op schema)
    torch.ops.symm_mem.one_shot_all_reduse(t, "sum", "0")      # 18: misspelled op
    x = dist.group.WORLDD                                      # 19: misspelled attribute
    dist.init_process_group("nccl", **{}, rnak=0)              # 20: wrong keyword beside **kwargs
    t.record_stream(s, s)                                      # 21: too many positionals (docstring)
    torch.cuda.current_stream().wait_evnt(c)                   # 22: misspelled method on a return value
'''

GOOD_SOURCE = BAD_SOURCE.replace("Evnt", "Event").replace("enable_timng", "enable_timing") \
    .replace("(True, False, False, False, False)", "(True, False, False, False)").replace("recrod", "record") \
    .replace("c, blocking=True", "c").replace("rendezvuos", "rendezvous").replace("chanel", "channel") \
    .replace("grp=", "group_name=").replace("all_reduse", "all_reduce").replace("WORLDD", "WORLD") \
    .replace("rnak", "rank").replace("(s, s)", "(s)").replace("wait_evnt", "wait_event")


def test_checker_reports_bad_calls() -> None:
    uses = collect_source(BAD_SOURCE, "bad.py")
    reported = {}
    for u in uses:
        for p in check(u).problems:
            reported.setdefault(u.line, []).append(p)
    expected = {8: "Evnt", 9: "enable_timng", 10: "too many positional", 11: "recrod", 13: "blocking",
                14: "rendezvuos", 16: "chanel", 17: "grp", 18: "one_shot_all_reduse", 19: "WORLDD",
                20: "rnak", 21: "too many positional", 22: "wait_evnt"}
    for line, word in expected.items():
        assert any(word in p for p in reported.get(line, [])), f"line {line} ({word}) not reported: {reported}"
        assert all(p.startswith(f"bad.py:{line}: ") for p in reported[line])
    assert set(reported) == set(expected), f"unexpected reports: {reported}"


def test_checker_accepts_the_corrected_calls() -> None:
    uses = collect_source(GOOD_SOURCE, "good.py")
    problems = [p for u in uses for p in check(u).problems]
    assert not problems, problems
    # ...and it did look at them: every line of the snippet that calls something was collected.
    assert {u.line for u in uses} >= {8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22}


@pytest.mark.parametrize("rel, old, new, word", [
    ("ficco_select/executor/cuda.py", "torch.cuda.Event(enable_timing=True)", "torch.cuda.Event(enable_timng=True)",
     "enable_timng"),
    ("ficco_select/executor/cuda.py", ".wait_event(", ".wait_evnt(", "wait_evnt"),
    ("ficco_select/executor/peer.py", "symm_mem.rendezvous(", "symm_mem.rendezvus(", "rendezvus"),
    ("ficco_select/executor/peer.py", "channel=channel", "chanel=channel", "chanel"),
    ("ficco_select/executor/peer.py", "storage_offset=", "offset=", "offset"),
    ("data/measure/node.py", "device_id=device", "device=device", "device=_"),
    ("data/gpu_profile/copies.py", "ev[0].elapsed_time(ev[1]) * 1e-3", "ev[0].elapsed_time(ev[1], ev[2]) * 1e-3",
     "too many positional"),
])
def test_checker_catches_a_mistake_in_the_real_files(rel: str, old: str, new: str, word: str) -> None:
    """The same mistake, made in memory in the real file, is reported (the typing reaches it)."""
    source = (ROOT / rel).read_text()
    assert old in source, f"{rel} no longer contains {old!r}: update this case"
    problems = [p for u in collect_source(source.replace(old, new), rel) for p in check(u).problems]
    lines = {i for i, text in enumerate(source.splitlines(), start=1) if old in text}
    assert problems and all(word in p for p in problems), problems
    # One report per changed line, at the line its call starts on (a call may span lines).
    reported = sorted(int(p.split(":")[1]) for p in problems)
    assert len(reported) == len(lines), (problems, lines)
    assert all(any(0 <= line - r <= 3 for line in lines) for r in reported), (problems, lines)
