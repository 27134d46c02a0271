"""The package's layers import one way: a module imports only from its own layer or earlier ones,
and the runtime not from the planner (runtime -> scheduler -> pricing -> costmodel).

The layers and their order are docs/design.md's table (read here, so the page and the check cannot
drift apart). Every import statement of every module under dflop/ counts, function-local ones too:
a lazy import still makes the lower layer depend on the upper one. The second test imports the
trainer in a fresh interpreter and looks at what came with it, which also sees imports made by
name at run time.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Beyond the order: (layer, layer it must not import although listed before it). The runtime trains
# whatever plan.yaml says and prices through dflop.pricing, as the planner does; neither needs the other.
NEVER = {("runtime", "planner")}

# (importing module, imported module): known exceptions, each with its reason.
ALLOWED = {
    # the model profiler's TP worker runs under torchrun and joins the process group as the
    # trainer's ranks do; not part of the pricing chain
    ("dflop.profiling.model_tp_worker", "dflop.runtime.process_group"),
}


def design_layers() -> list[tuple[str, tuple[str, ...]]]:
    """[(layer, module prefixes)] in docs/design.md's order, e.g. ("contracts", ("dflop.plan", "dflop.shapes"))."""
    text = (ROOT / "docs" / "design.md").read_text()
    table = text.split("## Layers", 1)[1].split("\n\n")[2]
    layers = []
    for row in table.splitlines()[2:]:  # past the header and its rule
        name, packages = (cell.strip() for cell in row.strip("|").split("|")[:2])
        paths = re.findall(r"`dflop/([\w/]+?)(?:\.py)?/?`", packages)
        layers.append((name, tuple("dflop." + p.replace("/", ".") for p in paths)))
    return layers


def layer_index(module: str, layers) -> int | None:
    """Position of `module`'s layer, None for shared helpers outside the table (dflop.io, ...)."""
    for index, (_, prefixes) in enumerate(layers):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def imports_of(source: str, filename: str = "<source>") -> list[tuple[int, str]]:
    """(line, module) of every absolute import of a dflop module in `source`, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "dflop":  # from dflop import plan: the module is dflop.plan
                found += [(node.lineno, f"dflop.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, node.module))
    return [(line, m) for line, m in found if m.startswith("dflop.")]


def package_sources() -> dict[str, tuple[str, str]]:
    """{module name: (file relative to the repository, source)} of every module under dflop/."""
    out = {}
    for path in sorted((ROOT / "dflop").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = (str(path.relative_to(ROOT)),
                                                                            path.read_text())
    return out


def upward_imports(sources: dict[str, tuple[str, str]], layers) -> list[str]:
    """'file:line: module (layer) imports other (layer)' for every import against the order or `NEVER`."""
    bad = []
    for me, (filename, source) in sources.items():
        mine = layer_index(me, layers)
        if mine is None:
            continue
        for line, other in imports_of(source, filename):
            theirs = layer_index(other, layers)
            wrong = theirs is not None and (theirs > mine or (layers[mine][0], layers[theirs][0]) in NEVER)
            if wrong and (me, other) not in ALLOWED:
                bad.append(f"{filename}:{line}: {me} ({layers[mine][0]}) imports {other} ({layers[theirs][0]})")
    return bad


def test_design_table_lists_the_pricing_chain_in_order():
    names = [name for name, _ in design_layers()]
    assert names.index("costmodel") < names.index("pricing") < names.index("scheduler") < names.index("planner") \
        < names.index("runtime")


def test_no_module_imports_a_later_layer():
    assert upward_imports(package_sources(), design_layers()) == []


def test_the_check_sees_a_lazy_upward_import():
    """The walk flags an import inside a function: a scheduler or pricing module reaching up to the
    planner, or the runtime to the report; and lets a downward one pass."""
    lazy = "def f():\n    from dflop.planner.means import PartMeans\n    return PartMeans\n"
    sources = {"dflop.scheduler.probe": ("probe.py", lazy), "dflop.pricing.probe": ("probe.py", lazy),
               "dflop.runtime.probe": ("probe.py", "from dflop import report\n"),
               "dflop.planner.probe": ("probe.py", "import dflop.pricing.pool\nfrom dflop.scheduler import padded\n")}
    assert len(upward_imports(sources, design_layers())) == 3
    runtime = {"dflop.runtime.probe": ("probe.py", lazy)}
    assert len(upward_imports(runtime, design_layers())) == 1


def test_the_trainer_loads_nothing_of_the_planner():
    """What importing the runtime's entry points really loads, in a fresh interpreter."""
    code = ("import sys, dflop.runtime.trainer, dflop.runtime.run, dflop.runtime.launch, dflop.scheduler, "
            "dflop.pricing.pricing\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('dflop.planner'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == []
