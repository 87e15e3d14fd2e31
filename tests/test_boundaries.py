"""No module of chorus reaches into another module's underscore names.

A name that starts with one underscore belongs to the module that defines it (and to its
subclasses, through ``self``).  Reading ``x._name`` is allowed only where ``_name`` is
defined in the same module (``self._name =
...``, ``def _name``, a module-level ``_name``); importing ``_name`` from another module
is never allowed.  The few private names of other libraries that chorus needs, with no
public equivalent, are listed in FOREIGN with the reason.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "chorus"

#: (module, attribute): why the foreign private name is needed
FOREIGN = {
    ("chorus/torch/sharing.py", "_share_fd_cpu_"):
        "torch has no public call that moves a storage into a shared file in place",
    ("chorus/bench/ddp.py", "_get_zeros_like_grad_buckets"):
        "DDP's buckets are reachable only through its reducer",
    **{(path, name): "the CUDA latency lane needs the current device and raw stream handle per call; "
                     "torch.cuda.current_stream() builds a Stream object each time"
       for path in ("chorus/cuda/component.py", "chorus/cuda/launchers.py", "chorus/cuda/work.py")
       for name in ("_C", "_cuda_getDevice", "_cuda_getCurrentRawStream")},
    **{(path, name): "whether the current stream is capturing a CUDA graph, on every CUDA call: "
                     "torch.cuda.is_current_stream_capturing() checks CUDA's state in Python first"
       for path in ("chorus/cuda/component.py", "chorus/cuda/capture.py")
       for name in ("_C", "_cuda_isCurrentStreamCapturing")},
    **{("chorus/cuda/nccl.py", name): "ProcessGroupNCCL's all_gather and reduce_scatter of one flat tensor of "
                                      "W blocks have only these names on the backend object (torch's own "
                                      "all_gather_into_tensor and reduce_scatter_tensor call them)"
       for name in ("_allgather_base", "_reduce_scatter_base")},
    ("chorus/bench/cuda.py", "_sleep"):
        "holding the GPU busy while the CPU enqueues a timed batch has no public call in torch",
    **{("chorus/torch/profiling.py", name): "a profiler event that shows the op's input tensors "
                                           "(record_function takes a string) and whether the profiler "
                                           "records have no public call in torch"
       for name in ("_record_function_with_args_enter", "_C", "_autograd", "_profiler_enabled")},
    **{("chorus/torch/profiling.py", name): "an event ended on another thread is recorded only under the "
                                           "caller's profiler state, which torch carries there only through "
                                           "this hook (record_function's own future hook, called as it calls it)"
       for name in ("_call_end_callbacks_on_jit_fut", "_RecordFunction")},
}


#: named tuples' public API (underscored only to keep clear of field names)
NAMEDTUPLE_API = {"_replace", "_fields", "_asdict", "_make", "_field_defaults"}


def _own_names(tree: ast.AST) -> set[str]:
    """Underscore names a module defines itself."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    for node in ast.walk(tree):  # __slots__ entries
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                for t in node.targets):
            for elt in getattr(node.value, "elts", []):
                if isinstance(elt, ast.Constant) and isinstance(elt.value, str):
                    names.add(elt.value)
    return {n for n in names if n.startswith("_")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def violations() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = str(path.relative_to(ROOT.parent))
        tree = ast.parse(path.read_text(), rel)
        own = _own_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("chorus"):
                found += [f"{rel}:{node.lineno}: imports {a.name} from {node.module}"
                          for a in node.names if _private(a.name)]
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                receiver = node.value.id if isinstance(node.value, ast.Name) else ""
                if (receiver in ("self", "cls") or node.attr in own or node.attr in NAMEDTUPLE_API
                        or (rel, node.attr) in FOREIGN):
                    continue
                found.append(f"{rel}:{node.lineno}: reads {ast.unparse(node)}")
    return found


def test_no_module_reads_another_modules_underscore_names():
    assert violations() == []


def test_the_check_sees_a_reach_into_another_module(tmp_path, monkeypatch):
    """The checker itself: a module reading another's private attribute is reported."""
    pkg = tmp_path / "chorus"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f(t):\n    return t._dead\n")
    (pkg / "b.py").write_text("from chorus.c import _helper\n")
    (pkg / "c.py").write_text("class C:\n    def __init__(self):\n        self._x = 1\n"
                              "    def same(self, other):\n        return other._x\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    assert [v.split(": ", 1)[1] for v in violations()] == ["reads t._dead", "imports _helper from chorus.c"]
