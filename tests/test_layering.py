"""The package layers, read from every module's import statements (ast: nothing is imported).

ops <- nn <- hf (with train and inference) <- recipes:
- ops imports no other lorafuse package and none of transformers, peft, accelerate;
- nn imports only ops (of lorafuse) and none of them either;
- only hf, train and inference import transformers or peft;
- recipes import lorafuse's public modules only;
- a private module (a name with a leading underscore) is imported only from inside the package that holds it.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
THIRD_PARTY = {"transformers", "peft", "accelerate"}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path) -> list[str]:
    """The absolute dotted names that a file imports (relative imports resolved against its package)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from package import module` imports the module: name each imported name under the base
            found += [base] + [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
    return found


def lorafuse_modules():
    return sorted((ROOT / "lorafuse").rglob("*.py"))


def layer(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def existing_module(name: str) -> str | None:
    """`name` if it is a lorafuse module or package, else its parent's (an imported function or class), else None."""
    while name.startswith("lorafuse"):
        path = ROOT / name.replace(".", "/")
        if path.with_suffix(".py").exists() or (path / "__init__.py").exists():
            return name
        name = name.rpartition(".")[0]
    return None


def test_the_rules_see_every_package():
    layers = {layer(module_name(p)) for p in lorafuse_modules()}
    assert {"ops", "nn", "hf", "train", "inference"} <= layers


@pytest.mark.parametrize("path", lorafuse_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_layers(path):
    name = module_name(path)
    own = layer(name)
    for imported in imports(path):
        top = imported.split(".")[0]
        other = layer(imported) if top == "lorafuse" else None
        if own in ("ops", "nn"):
            assert top not in THIRD_PARTY, f"{name} imports {imported}: ops and nn stay free of {sorted(THIRD_PARTY)}"
        if own == "ops":
            assert other in (None, "ops", "_logging"), f"{name} imports {imported}: ops imports no other layer"
        if own == "nn":
            assert other in (None, "ops", "nn", "_logging"), f"{name} imports {imported}: nn imports only ops"
        if top in ("transformers", "peft"):
            assert own in ("hf", "train", "inference"), f"{name} imports {imported}: only hf, train and inference may"


def private_part(module: str) -> str | None:
    """The package holding the first private segment of a module's name (None: no private segment)."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


@pytest.mark.parametrize("path", lorafuse_modules() + sorted((ROOT / "recipes").glob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_private_modules_stay_in_their_package(path):
    name = module_name(path)
    for imported in imports(path):
        module = existing_module(imported)
        holder = private_part(module) if module else None
        if holder is not None:
            assert name == holder or name.startswith(holder + "."), \
                f"{name} imports {module}, a private module of {holder}"


def test_recipes_use_the_public_api():
    for path in sorted((ROOT / "recipes").glob("*.py")):
        for imported in imports(path):
            module = existing_module(imported)
            if module is not None:
                assert private_part(module) is None, f"{path.name} imports {module}"


def test_a_violation_is_caught(tmp_path, monkeypatch):
    # the rules above read real files: a planted ops module that imports transformers and a private hf helper fails
    planted = ROOT / "lorafuse" / "ops" / "_planted_for_test.py"
    planted.write_text("import transformers\nfrom ..hf import lora\nfrom .._logging import log_once\n")
    try:
        with pytest.raises(AssertionError, match="transformers"):
            test_layers(planted)
        assert "lorafuse.hf.lora" in imports(planted) and "lorafuse._logging.log_once" in imports(planted)
    finally:
        planted.unlink()
