"""The README's reading-order table (kvmini.eval.reading): the files met depth first, lines counted by hand."""
from kvmini.eval import reading


def write(root, files):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_a_toy_package_is_read_depth_first_in_the_order_imports_are_written(tmp_path, monkeypatch):
    write(tmp_path, {
        "kvmini/__init__.py": "",
        "kvmini/generate.py": '"""Generate. More."""\nfrom kvmini.model import f\nimport kvmini.errors\n',
        "kvmini/model.py": '"""The model."""\n\nfrom kvmini.cache import C\n\n# a comment\nx = 1\n',
        "kvmini/cache.py": "import torch\n",
        "kvmini/errors.py": "from kvmini.methods.registry import y\n",
        "kvmini/policy.py": "from kvmini import errors\n",
        "kvmini/methods/__init__.py": "",
        "kvmini/methods/registry.py": "",
        "kvmini/methods/toy.py": '"""Toy (Eq. 3): a method. Second sentence."""\nfrom kvmini.policy import P\n',
    })
    monkeypatch.setattr(reading, "running", lambda method, root: ["kvmini/cache.py"])
    assert reading.path("toy", tmp_path) == [  # registry is never followed; a file is met once
        "kvmini/generate.py", "kvmini/model.py", "kvmini/cache.py", "kvmini/errors.py", "kvmini/methods/toy.py",
        "kvmini/policy.py", "kvmini/__init__.py"]  # `from kvmini import errors` opens the package too
    assert reading.lines("kvmini/model.py", tmp_path) == 4  # blank lines only are left out
    assert reading.summary("kvmini/methods/toy.py", tmp_path) == "Toy (Eq. 3): a method."
    table = reading.table(("toy",), tmp_path).splitlines()  # 3 + 4 + 1 + 1 + 1 + 0 + 2 lines
    assert table[-1] == "| | **total** | | 7 files, 12 lines | |"
    assert table[2] == "| 1 | `kvmini/generate.py` | 3 | ✓ | Generate. |"


def test_the_path_of_a_method_holds_its_module_and_what_make_policy_builds():
    files = reading.path("d2o")
    assert {"kvmini/methods/d2o.py", "kvmini/methods/method.py", "kvmini/model.py", "kvmini/cache.py"} <= set(files)
    assert "kvmini/methods/registry.py" not in files and "kvmini/methods/h2o.py" not in files
