"""The import graph keeps its contracts: the runtime and the server see programs only through
dflash_ir/program.py, never a backend's or the interpreter's insides, and the contract's
types are imported from that module only."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# installed package -> source folder (pyproject.toml's package-dir)
SOURCES = {"dflash_ir": ROOT / "dflash_ir", "dflash_ir.backends": ROOT / "backends",
           "dflash_ir.models": ROOT / "models", "dflash_ir.passes": ROOT / "passes"}
CONTRACT = {"Program", "RunResult", "WeightLoader", "BindError", "DeviceArray", "check_weight"}
# what the runtime and the server may not reach into
FORBIDDEN = ("dflash_ir.backends", "dflash_ir.interpreter")


def all_modules() -> dict[str, Path]:
    """Module name -> source file, for every module of the installed package."""
    out = {}
    for pkg, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def module_files(package: str) -> list[tuple[str, Path]]:
    return [(m, p) for m, p in all_modules().items() if m == package or m.startswith(package + ".")]


def imports(module: str, path: Path):
    """(imported module, imported name or None, line) of every import in the file, relative
    imports resolved, function-level ones included."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join([*parent, *([base] if base else [])])
            for alias in node.names:
                yield base, alias.name, node.lineno


def reaches(target: str, name: str | None, forbidden: str) -> bool:
    full = f"{target}.{name}" if name else target
    return any(m == forbidden or m.startswith(forbidden + ".") for m in (target, full))


@pytest.mark.parametrize("package", ["dflash_ir.runtime", "dflash_ir.serve"])
def test_runtime_and_server_import_no_backend_or_interpreter(package):
    files = list(module_files(package))
    assert files, f"no source files found for {package}"
    bad = [f"{path.relative_to(ROOT)}:{line}: {target}{'.' + name if name else ''}"
           for module, path in files for target, name, line in imports(module, path)
           for forbidden in FORBIDDEN if reaches(target, name, forbidden)]
    assert not bad, "the runtime sees programs only through dflash_ir.program:\n" + "\n".join(bad)


def test_contract_types_come_from_the_program_module():
    bad = [f"{path.relative_to(ROOT)}:{line}: {name} from {target}"
           for module, path in all_modules().items() if module != "dflash_ir.program"
           for target, name, line in imports(module, path) if name in CONTRACT and target != "dflash_ir.program"]
    assert not bad, "import the contract from dflash_ir.program:\n" + "\n".join(bad)


def test_importing_the_runtime_loads_no_backend():
    """The same, transitively: what importing the runtime and the server's engine side pulls in."""
    modules = [m for m, _ in module_files("dflash_ir.runtime")] + ["dflash_ir.serve.slot_state",
                                                                  "dflash_ir.serve.scheduler"]
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('dflash_ir'))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "dflash_ir.program" in loaded
    assert not [m for m in loaded if any(reaches(m, None, f) for f in FORBIDDEN)], loaded


def test_test_machinery_is_not_installed():
    """The oracle fixture loader lives under tests/, not in the package."""
    names = set(all_modules())
    assert "dflash_ir.program" in names and "dflash_ir.fixtures" not in names
