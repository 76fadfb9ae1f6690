"""The options README.md and docs/DESIGN.md name are the configuration's (a renamed or removed
key left in the prose sends a reader to a command that is refused), and trainer/config.py,
where README.md sends readers for every key, has a comment for each."""
import ast
import importlib
import re
from pathlib import Path

import pytest

from trainer.config import CONF, GROUPS, TrainConfig, options

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "docs" / "DESIGN.md"]
SECTIONS = {key.split(".")[0] for key in options(TrainConfig()) if "." in key}
FILES = (".md", ".json", ".jsonl", ".log", ".png", ".pt", ".py", ".yaml")  # names the run writes or the repo holds


def code(name: str) -> bool:
    """Whether section.name is a function or value of the module of that name (dist._attempt_store)."""
    module, _, attribute = name.partition(".")
    try:
        return hasattr(importlib.import_module(f"trainer.{module}"), attribute)
    except ImportError:
        return False


def named_keys(text: str) -> set[str]:
    """The keys a text gives values to (key=value, +key=value) and the backticked section.key names it
    mentions that are neither a file's name nor code's (bench.md, dist.launch_overrides)."""
    given = {key.lstrip("+~") for key in re.findall(r"(?<![\w./-])([+~]?[a-z_]+(?:\.[a-z_0-9]+)*)=(?!=)", text)}
    mentioned = {name for name in re.findall(r"`([a-z_]+\.[a-z_0-9]+)`", text)
                 if name.split(".")[0] in SECTIONS and not name.endswith(FILES) and not code(name)}
    return given | mentioned


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_the_options_the_docs_name_are_the_configurations(doc):
    keys = set(options(TrainConfig()))
    unknown = sorted(key for key in named_keys(doc.read_text())
                     if key not in keys and key not in GROUPS and key.split(".")[0] not in ("hydra", "compile_options"))
    assert not unknown, f"{doc.name} names options the configuration does not have: {unknown}"


def test_the_group_options_the_readme_names_are_in_conf():
    chosen = re.findall(rf"(?<![\w.+])\+?({'|'.join(GROUPS)})=([\w,|]+)", (ROOT / "README.md").read_text())
    missing = sorted(f"{group}={option}" for group, names in chosen for option in re.split(r"[,|]", names)
                     if not (CONF / group / f"{option}.yaml").exists())
    assert not missing, f"README.md chooses group options conf/ does not have: {missing}"


def test_every_key_is_documented_in_the_schema():
    """README.md sends readers to trainer/config.py for every key: each field of its dataclasses has a comment on
    its line or on the line above (a section, model: ModelConfig, is its class's fields)."""
    source = (ROOT / "trainer" / "config.py").read_text()
    lines = source.splitlines()
    bare = [f"{cls.name}.{node.target.id}" for cls in ast.parse(source).body if isinstance(cls, ast.ClassDef)
            and any(ast.unparse(d) == "dataclass" for d in cls.decorator_list)
            for node in cls.body if isinstance(node, ast.AnnAssign) and not ast.unparse(node.annotation).endswith("Config")
            and "#" not in lines[node.lineno - 1] and not lines[node.lineno - 2].lstrip().startswith("#")]
    assert not bare, f"trainer/config.py leaves these keys without a comment: {bare}"
