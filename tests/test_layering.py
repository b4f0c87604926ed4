"""The import direction of the package: serve -> engine -> sharding -> model -> kernel registry ->
kernels -> ops (DESIGN.md §6). A lower layer never imports a higher one, not even lazily inside a
function, so each layer can be read, tested and replaced on its own."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package (directory under the repository root) -> packages it must never import
FORBIDDEN = {
    "ops": ("model", "pallas_kernels", "sharding", "serve"),
    "pallas_kernels": ("model", "sharding", "serve"),
    "model": ("sharding", "serve"),
    "sharding": ("serve",),
    "serve/engine": ("serve.api", "serve.grpc", "serve.cli"),  # serve.text (detokenizer, stops) lies below it
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_points_up(package):
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no Python files under {package}/"
    violations = []
    for path in files:
        for line, module in imported_modules(path):
            for banned in FORBIDDEN[package]:
                name = f"deepinfer.{banned}"
                if module == name or module.startswith(name + "."):
                    violations.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not violations, "imports against the layering:\n" + "\n".join(violations)


def test_the_check_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from deepinfer.model.config import ModelConfig\n")
    assert imported_modules(bad) == [(2, "deepinfer.model.config")]
