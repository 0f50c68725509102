"""The models guide's op table is generated from hpcpar.nn.optable (docs/optable_table.py):
the page holds exactly what the generator gives, so an op added to the table, or moved to
another class, shows in the guide (run ``python docs/optable_table.py``)."""

import importlib.util
from pathlib import Path

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "setup.cfg").exists())


def _generator():
    spec = importlib.util.spec_from_file_location("optable_table", ROOT / "docs" /
                                                  "optable_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_guides_op_table_is_the_generated_one():
    gen = _generator()
    page = gen.PAGE.read_text()
    assert gen.render() in page, "docs/guides/models.md: run python docs/optable_table.py"
    assert gen.rewrite(page) == page


def test_every_op_of_the_table_is_in_the_guide():
    from hpcpar.nn import optable

    block = _generator().render()
    missing = [name for name, _ in optable.table() if f"`{name}`" not in block]
    assert not missing, missing
