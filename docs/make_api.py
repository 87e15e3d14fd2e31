"""docs/api.md, the API reference, from the docstrings and signatures of chorus's public names.

usage: python3 docs/make_api.py            rewrite docs/api.md
       python3 docs/make_api.py --check    exit 1 if docs/api.md differs from what the code says
       python3 docs/make_api.py --print    print the page instead of writing it

The page lists every name of ``chorus.__all__``, grouped as ``GROUPS`` says, plus the
public names of ``chorus.torch``, ``chorus.launch`` and ``chorus.utils`` that ``GROUPS``
names; a name of ``chorus.__all__`` that no group holds is an error (add it to a group).
Signatures are printed as the source writes them (``op=ReduceOp.SUM``), read with ``ast``,
so the page does not depend on the installed numpy or torch.  Importing ``chorus.torch``
needs torch (the ``[torch]`` or ``[test]`` extra).

Docstrings become Markdown by paragraph: a paragraph whose lines start with ``rank `` (an
example of what each rank passes and gets), one indented under its first line, and one
that follows a line ending in ``::`` are shown as code; the others are prose, with
``name`` written as `name`.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import os
import re
import sys
import textwrap

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
PAGE = os.path.join(DOCS, "api.md")

#: (title, introduction, names).  A bare name is ``chorus.<name>``; ``module:name`` is a
#: name of another public module.  A class's methods are the public ones its own body adds
#: (not overrides), or the ones listed in brackets: ``ProcessGroup[rank,size]``.
GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("Setup",
     "Join and leave the job, and ask about it. `import chorus as dist` stands in for "
     "`import torch.distributed as dist`.",
     ("init_process_group", "destroy_process_group", "is_initialized", "get_rank", "get_world_size",
      "get_backend", "Backend", "is_available", "is_gloo_available", "is_nccl_available", "is_mpi_available",
      "is_torchelastic_launched")),
    ("Point-to-point",
     "One rank sends, one receives. A send returns once its data is on its way: chorus buffers "
     "sends that torch.distributed's backends may block on.",
     ("send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv")),
    ("Collectives",
     "Every rank of the group calls the same collective, in the same order. Tensors are numpy "
     "arrays or torch tensors (CPU, or CUDA with `chorus[cuda]`); the ops fill them in place. "
     "With `async_op=True` a call returns a `Work` to wait on. `algorithm=` (chorus's own "
     "keyword) forces one of `chorus explain`'s algorithms.",
     ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
      "gather", "scatter", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all",
      "all_to_all_single", "barrier", "monitored_barrier", "ReduceOp", "_make_nccl_premul_sum",
      "Work[wait,is_completed,is_success,exception,result,get_future]",
      "Future[wait,value,done,then,add_done_callback]", "empty_shared")),
    ("Object collectives",
     "Picklable Python objects instead of tensors, for small control data (configs, metrics). "
     "Without a job token only safe types are unpickled; README's \"Security\" section says which.",
     ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
      "send_object_list", "recv_object_list", "add_safe_globals", "get_safe_globals",
      "clear_safe_globals")),
    ("Groups",
     "Sub-groups of the world. Creating one is collective: every rank of the world calls it, "
     "in the same order.",
     ("new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group",
      "get_process_group_ranks", "get_group_rank", "get_global_rank", "group", "GroupMember",
      "ProcessGroup[rank,size,is_member]")),
    ("Mesh",
     "An n-dimensional grid of ranks with a group per line of each dimension; also reachable as "
     "`chorus.device_mesh.init_device_mesh`.",
     ("init_device_mesh", "DeviceMesh")),
    ("Launcher",
     "Start the ranks of a job: `chorusrun` (or `python3 -m chorus.run`) from the shell, with "
     "torchrun's options (table below), or `chorus.spawn` from Python, like "
     "`torch.multiprocessing.spawn`.",
     ("spawn", "set_start_method", "get_start_method", "chorus.launch:ProcessRaisedException",
      "chorus.launch:ProcessExitedException")),
    ("Stores",
     "Key-value stores for rendezvous, with torch.distributed's interface; "
     "`init_process_group(store=...)` takes one.",
     ("Store", "TCPStore", "FileStore", "HashStore", "PrefixStore")),
    ("Torch backend",
     "`import chorus.torch` registers backend \"chorus\" with torch.distributed; training code "
     "stays torch's, and DDP, FSDP2, DeviceMesh and DTensor run on chorus:\n\n"
     "```python\nimport torch.distributed as dist\nimport chorus.torch                # registers "
     "backend \"chorus\" (CPU and CUDA tensors)\n\ndist.init_process_group(\"chorus\")   # or "
     "\"cpu:chorus,cuda:nccl\" to keep NCCL for CUDA tensors\n```",
     ("chorus.torch:register",)),
    ("Helpers",
     "`chorus.utils`: the small helpers of a training script, which also work when the job is not "
     "distributed.",
     ("chorus.utils:reduce_tensor", "chorus.utils:gather_tensor", "chorus.utils:broadcast_tensor",
      "chorus.utils:all_gather_tensor", "chorus.utils:barrier", "chorus.utils:is_main_process",
      "chorus.utils:is_distributed", "chorus.utils:get_rank", "chorus.utils:get_world_size",
      "chorus.utils:get_device")),
    ("Errors",
     "Every error derives from `ChorusError`; bad arguments also from `ValueError` or "
     "`TypeError`, timeouts from `TimeoutError`. Messages name the op, its sequence number, "
     "the ranks and the fix.",
     ("ChorusError", "InvalidArgumentError", "InvalidTensorError", "NotInitializedError", "RendezvousError",
      "AuthenticationError", "StoreTimeoutError", "CommTimeoutError", "PeerLostError", "CollectiveMismatchError",
      "BufferMismatchError", "ConcurrentCallError", "AbortedError", "ProtocolError", "UnsafeObjectError")),
)


# --- finding the names ------------------------------------------------------------------

def resolve(entry: str) -> tuple[str, object, tuple[str, ...] | None]:
    """(qualified name, object, listed methods or None) of one GROUPS entry."""
    methods = None
    if entry.endswith("]"):
        entry, listed = entry[:-1].split("[")
        methods = tuple(listed.split(","))
    module, _, name = entry.rpartition(":")
    module = module or "chorus"
    return f"{module}.{name}", getattr(importlib.import_module(module), name), methods


def unplaced() -> list[str]:
    """Names of ``chorus.__all__`` that no group holds."""
    import chorus

    placed = {entry.split("[")[0] for _, _, entries in GROUPS for entry in entries if ":" not in entry}
    return sorted(set(chorus.__all__) - placed)


# --- signatures -------------------------------------------------------------------------

def _def_node(obj) -> ast.FunctionDef | None:
    """The ``def`` of a function, or of a class's ``__init__`` (``__new__``), as parsed."""
    if inspect.isclass(obj):
        for name in ("__init__", "__new__"):
            fn = obj.__dict__.get(name)
            if fn is not None:
                node = _def_node(fn)
                return node
        return None
    fn = obj.fget if isinstance(obj, property) else obj
    if not inspect.isfunction(fn):
        return None
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    node = tree.body[0]
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _params(args: ast.arguments, drop_first: bool) -> list[str]:
    """Each parameter as PEP 8 writes it (``name: type = default``); ``_private`` ones left out."""

    def one(arg: ast.arg, default: ast.expr | None) -> str:
        text = arg.arg + (f": {ast.unparse(arg.annotation)}" if arg.annotation else "")
        if default is not None:
            text += (" = " if arg.annotation else "=") + ast.unparse(default)
        return text

    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [one(a, d) for a, d in zip(positional, defaults, strict=True)]
    if drop_first:
        out = out[1:]
    if args.posonlyargs:
        out.insert(len(args.posonlyargs) - drop_first, "/")
    if args.vararg:
        out.append("*" + one(args.vararg, None))
    elif args.kwonlyargs:
        out.append("*")
    out += [one(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)]
    if args.kwarg:
        out.append("**" + one(args.kwarg, None))
    return [p for p in out if not p.startswith("_")]


def _bases(cls) -> str:
    return ", ".join(b.__name__ for b in cls.__bases__ if b is not object)


def signature(name: str, obj, method: bool = False) -> str:
    """``name(args) -> returns`` as the source writes it, one parameter a line when long; a
    class without a constructor of its own shows its bases."""
    short = name.rsplit(".", 1)[1]
    node = _def_node(obj)
    is_class = inspect.isclass(obj)
    if node is None:
        if is_class:
            return f"class {short}({_bases(obj)})" if _bases(obj) else f"class {short}"
        return short
    params = _params(node.args, drop_first=method or is_class)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None and not is_class else ""
    prefix = "class " if is_class else ""
    text = f"{prefix}{short}({', '.join(params)}){returns}"
    if len(text) > 100:
        text = f"{prefix}{short}(\n" + "".join(f"    {p},\n" for p in params) + f"){returns}"
    if is_class and _bases(obj):
        text += f"  # bases: {_bases(obj)}"
    return text


def members(cls, listed: tuple[str, ...] | None) -> list[tuple[str, object]]:
    """The methods and properties to show under a class: those listed, else the public ones
    its body adds (an override of a base class's method is documented there)."""
    if listed is not None:
        return [(m, inspect.getattr_static(cls, m)) for m in listed]
    return [(m, v) for m, v in cls.__dict__.items()
            if not m.startswith("_") and (inspect.isfunction(v) or isinstance(v, property)) and v.__doc__
            and not any(m in base.__dict__ for base in cls.__mro__[1:])]


# --- docstrings -------------------------------------------------------------------------

_ROLE = re.compile(r":(?:class|func|meth|mod|attr):`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def _prose(text: str) -> str:
    text = _ROLE.sub(r"`\1`", text)
    text = _LITERAL.sub(r"`\1`", text)
    return text.replace(".. warning::", "**Warning.**").replace(".. note::", "**Note.**")


def _runs(lines: list[str], after_colons: bool) -> list[tuple[bool, list[str]]]:
    """A paragraph's lines as runs of (is code, lines): the whole paragraph after ``::`` or
    when indented; else a line starting with ``rank `` and the indented lines after it."""
    if after_colons or lines[0].startswith(" "):
        return [(True, lines)]
    runs: list[tuple[bool, list[str]]] = []
    for line in lines:
        code = line.startswith("rank ") or (line.startswith(" ") and bool(runs) and runs[-1][0])
        if runs and runs[-1][0] == code:
            runs[-1][1].append(line)
        else:
            runs.append((code, [line]))
    return runs


def markdown(doc: str) -> str:
    """A docstring (as ``inspect.getdoc`` gives it) in Markdown."""
    blocks: list[tuple[bool, list[str]]] = []  # (is code, lines), code paragraphs joined
    after_colons = False
    for paragraph in re.split(r"\n\s*\n", doc.strip()):
        lines = paragraph.split("\n")
        literal = after_colons or (lines[0].startswith(" ") and blocks and blocks[-1][0])
        for code, run in _runs(lines, literal):
            if code and literal and blocks and blocks[-1][0] and not after_colons:
                blocks[-1][1].extend(["", *run])  # a literal block's next paragraph
            else:
                blocks.append((code, run))
        after_colons = lines[-1].rstrip().endswith("::")
    return "\n\n".join("```text\n" + textwrap.dedent("\n".join(run)) + "\n```" if code
                       else _prose(" ".join(line.strip() for line in run)).replace("::", ":")
                       for code, run in blocks)


# --- the page ---------------------------------------------------------------------------

def entry(name: str, obj, listed, shown: set[str]) -> str:
    """One name: heading, signature, docstring, and a class's methods.  A function already
    shown under another name (``shown``) is named instead of shown again."""
    kind = "class" if inspect.isclass(obj) else "function" if callable(obj) else "object"
    parts = [f"### `{name}`", "", f"```python\n{signature(name, obj)}\n```"]
    target = f"{name.rsplit('.', 1)[0]}.{getattr(obj, '__name__', '')}"
    if kind == "function" and target != name and target in shown:
        parts += ["", f"The same function as `{target}`."]
    else:
        doc = inspect.getdoc(obj if kind != "object" else type(obj))
        if doc:
            parts += ["", markdown(doc)]
    if kind == "class":
        for member, value in members(obj, listed):
            parts += ["", f"#### `{name.rsplit('.', 1)[1]}.{member}`"]
            if isinstance(value, property):
                parts += ["", "A property."]
            else:
                parts += ["", f"```python\n{signature(name + '.' + member, value, method=True)}\n```"]
            doc = inspect.getdoc(value)
            if doc:
                parts += ["", markdown(doc)]
    return "\n".join(parts)


def chorusrun_options() -> str:
    """``chorusrun``'s options as a table, from its argument parser."""
    from chorus.launch.cli import build_parser

    rows = ["| option | default | meaning |", "|---|---|---|"]
    for action in build_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        names = ", ".join(f"`{o}`" for o in action.option_strings if "_" not in o)
        default = "" if action.default is None or action.default is False else f"`{action.default}`"
        rows.append(f"| {names} | {default} | {action.help} |")
    return "\n".join(rows)


def page() -> str:
    missing = unplaced()
    if missing:
        raise SystemExit(f"make_api.py: chorus.__all__ has names no group holds: {missing}; "
                         "add each to one of GROUPS in docs/make_api.py")
    head = [
        "# API reference",
        "",
        "<!-- written by `python3 docs/make_api.py` from the docstrings; edit those, not this page -->",
        "",
        "`import chorus as dist` gives torch.distributed's names with the same signatures and "
        "semantics; the examples below show, rank by rank, what each call is given and what it "
        "leaves. Unless a group is passed, an op runs on the world (every rank of the job); "
        "`src`, `dst` and ranks in lists are global ranks, and `group_src` / `group_dst` give them "
        "as ranks within `group`.",
        "",
    ]
    head += [f"- [{title}](#{title.lower().replace(' ', '-')})" for title, _, _ in GROUPS]
    body, shown = [], set()
    for title, intro, entries in GROUPS:
        body += ["", f"## {title}", "", intro]
        if title == "Launcher":
            body += ["", "`chorusrun` options (torchrun's `--under_scores` spellings work too):", "",
                     chorusrun_options()]
        for item in entries:
            name, obj, listed = resolve(item)
            body += ["", entry(name, obj, listed, shown)]
            shown.add(name)
    return "\n".join(head + body) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    parser.add_argument("--print", action="store_true", help="print the page instead of writing it")
    args = parser.parse_args(argv)
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)  # this checkout's chorus, also when another one is installed
    text = page()
    if args.print:
        sys.stdout.write(text)
        return 0
    old = open(PAGE).read() if os.path.exists(PAGE) else ""
    if args.check:
        if old != text:
            print("docs/api.md differs from the docstrings: run python3 docs/make_api.py", file=sys.stderr)
            return 1
        return 0
    if old != text:
        with open(PAGE, "w") as f:
            f.write(text)
        print("wrote docs/api.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
